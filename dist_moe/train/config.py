"""Loading a training config: the embedded default, a YAML file, then key=value overrides, merged
as mappings and parsed once into the typed ``RunConfig`` (its schema: ``dist_moe/train/run_config.py``).

Every section is merged against the default's keys, so a typo fails with the key's name instead of
being ignored. Router keys are checked at load as far as they can be before the data and the layer
are known, and in full when the layer builds the router. Files are read within placement.files'
limits (size, nesting, aliases, no duplicate keys).
"""
from __future__ import annotations

import copy
import hashlib
from dataclasses import fields
from pathlib import Path

import yaml

from dist_moe.config.hf_defaults import apply_hf_defaults, given_keys
from dist_moe.errors import did_you_mean, shown
from dist_moe.routing.registry import ROUTERS, accepted_keys, config_class
from dist_moe.train.checkpoint import store as checkpoint
from dist_moe.train.run_config import OLD_DISPATCHER_KEYS, RunConfig, verbatim_keys
from dist_moe.train.step.engines import ENGINES
from placement import parse_yaml, read_yaml, yaml_problem

DEFAULT_CONFIG: dict = RunConfig().to_dict()  # the embedded default, as a mapping (configs/demo.yaml writes it out)
_OPEN_SECTIONS = {"router", "train.gar"}  # a mapping per router type / GAR: checked when parsed, not against defaults

# keys that moved, still read (merged as given; RunConfig.from_dict maps them to their new key)
DEPRECATED_KEYS = {f"parallel.{key}" for key in OLD_DISPATCHER_KEYS}


def _merge(base: dict, update: dict, path: str = "") -> dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        where = f"{path}{key}"
        if path.rstrip(".") in _OPEN_SECTIONS:
            # router.subtree_limit.node=2 updates one level of a mapping, it does not drop the others
            out[key] = _merge_open(out.get(key), value)
            continue
        if key not in base and where in DEPRECATED_KEYS:  # read by RunConfig.from_dict, with a warning
            out[key] = value
            continue
        if key not in base:
            raise ValueError(f"unknown config key {shown(where)}{did_you_mean(key, base, path)}; "
                             f"valid keys here: {sorted(base)}")
        if isinstance(base[key], dict):
            if value is None and where in _OPEN_SECTIONS:  # train.gar=null: no GAR, as the schema says
                out[key] = None
                continue
            if not isinstance(value, dict):
                raise ValueError(f"config key {shown(where)} must be a mapping, got {shown(value)}")
            if key in _OPEN_SECTIONS and "type" in value and value["type"] != base[key].get("type"):
                out[key] = _switch_router_type(base[key], value)
                continue
            out[key] = _merge(base[key], value, where + ".")
        else:
            out[key] = value
    return out


def _merge_open(old, new):
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: _merge_open(old.get(k), v) for k, v in new.items()}}
    return copy.deepcopy(new)


def _switch_router_type(old: dict, new: dict) -> dict:
    """A full router section replaces the old one; a bare ``router.type=X`` keeps the old
    keys that router X also takes (num_experts, top_k, ...) and drops the rest."""
    if set(new) != {"type"}:
        return copy.deepcopy(new)
    if new["type"] not in ROUTERS:
        return dict(new)  # build_router names the bad type
    keep = accepted_keys(new["type"])
    return {"type": new["type"], **{k: v for k, v in old.items() if k in keep}}


def _keep_given_router_keys(router: dict, given: dict[str, str], item: str) -> None:
    """A router key set on the command line is never dropped by a later ``router.type=X`` whose
    router does not take it (the config file's keys are: that is what the bare type switch is for)."""
    if not isinstance(router, dict):  # null: model.kind hf's own router (apply_hf_defaults names a key given)
        return
    lost = [k for k in given if k not in router]
    if lost and router.get("type") in ROUTERS:  # an unknown type is named by the router check instead
        raise ValueError(f"override {shown(item)} drops router.{lost[0]}, set by override {shown(given[lost[0]])}: "
                         f"router type {router.get('type')!r} does not take it; give one of the two")


VERBATIM = verbatim_keys()  # paths and names: output.dir, model.path, data.name, ...


def parse_override(item: str) -> dict:
    """'train.lr=3e-4' -> {'train': {'lr': 0.0003}} (values parsed as YAML; a path's text as written, an empty
    value null)."""
    if "=" not in item:
        raise ValueError(f"override {shown(item)} must look like key.sub=value")
    key, raw = item.split("=", 1)
    try:
        value = (raw if key.strip() in VERBATIM else parse_yaml(raw)) if raw else None
    except yaml.YAMLError as e:
        raise ValueError(f"override {shown(item)}: the value is not valid YAML ({yaml_problem(e)})") from None
    nested: dict = value
    for part in reversed(key.strip().split(".")):
        if not part:
            raise ValueError(f"override {shown(item)} has an empty key component")
        nested = {part: nested}
    return nested


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """The run's typed config; a ValueError names the first bad key (before any data or process group)."""
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    if path is not None:
        loaded = read_yaml(path, "config")
        loaded = {} if loaded is None else loaded
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping")
        cfg = _merge(cfg, loaded)
        set_keys = given_keys(loaded, f"config file {str(path)!r}")
    else:
        set_keys = {}
    given: dict[str, str] = {}  # router key -> the override that set it
    for item in overrides:
        update = parse_override(item)
        cfg = _merge(cfg, update)
        _keep_given_router_keys(cfg["router"], given, item)
        if isinstance(update.get("router"), dict):
            given.update({k: item for k in update["router"] if k != "type"})
        set_keys.update(given_keys(update, f"override {shown(item)}"))
    named_by_folder = "name" not in set_keys and cfg["model"].get("kind") == "hf"
    cfg = apply_hf_defaults(cfg, set_keys)
    # a model folder names its run: the keys that chose it need no tag
    cfg["name"] = run_name(cfg["name"], overrides, untagged=("model.kind", "model.path") if named_by_folder else ())
    return RunConfig.from_dict(cfg)


def run_name(name: str, overrides, untagged: tuple[str, ...] = ()) -> str:
    """``name`` plus the overrides that change the model, its data or its engine (``+router.variant=uniform``), so
    that a control run gets an output directory of its own instead of overwriting the config's run;
    unchanged when the overrides set ``name`` or ``output.dir`` themselves."""
    keys = [item.split("=", 1)[0].strip() for item in overrides]
    if any(k == "name" or k.startswith("output.") for k in keys):
        return name
    named = (*MODEL_SECTIONS, "seed", "engine")
    tags = [item.strip() for item, k in zip(overrides, keys)
            if (k.split(".")[0] in named or k.split(".")[:2] == ["train", "gar"]) and k not in untagged]
    full = name + "".join("+" + t.replace("/", "_").replace("\\", "_").replace("..", "_").replace(" ", "")
                          for t in tags)
    return _fits_a_directory_name(full)


# a file name's bytes on Linux, macOS and Windows filesystems; some room left for a suffix
NAME_BYTES = 200


def _fits_a_directory_name(name: str) -> str:
    """``name``, or its first bytes plus a hash of all of it where it is too long to name a directory."""
    raw = name.encode()
    if len(raw) <= NAME_BYTES:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:12]
    return raw[:NAME_BYTES - len(digest) - 1].decode(errors="ignore") + "+" + digest


# Sections whose values make the model (or the data a position points into): a resume that
# changes any of them would mix two configs in one run.
MODEL_SECTIONS = ("router", "model", "data")


def _leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def model_changes(saved: dict, cfg: RunConfig) -> list[tuple[str, object, object]]:
    """(key, checkpoint's value, this run's value) for every model-making key that differs, plus ``seed``
    (it orders the data the saved position counts into) and the keys the run's engine cannot carry over
    (``Engine.resume_keys``). A checkpoint keeps its run's whole config (``to_dict(full=True)``); the two
    are compared leaf by leaf, as the checkpoint holds them, without parsing the saved one again: a
    checkpoint written before a key existed (or keeping only a router's non-default keys, or GAR's
    settings under ``router.gar``) resumes as it was saved, its missing keys at their defaults."""
    engine_keys = ENGINES[cfg.engine].resume_keys

    # model.kind hf routes with the model's own router: a router section its checkpoint saved was never read
    sections = tuple(s for s in (*MODEL_SECTIONS, "seed") if not (cfg.model.kind == "hf" and s == "router"))

    def compared(config: dict) -> dict:
        return {k: v for k, v in _leaves(config).items() if k.split(".")[0] in sections or k in engine_keys}

    old, new = compared(_with_defaults(saved)), compared(checkpoint.as_saved(cfg.to_dict(full=True)))
    return [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def _with_defaults(saved: dict) -> dict:
    """A checkpoint's config with every key it lacks at its default: ``DEFAULT_CONFIG``'s, and for the router
    its type's constructor defaults (a config saved with only the keys that differ from them). GAR's settings
    saved under ``router.gar`` move to ``train.gar``, where this release keeps them."""
    out = {**copy.deepcopy(DEFAULT_CONFIG), **saved}
    for name, section in DEFAULT_CONFIG.items():
        if isinstance(section, dict) and isinstance(out[name], dict) and name != "router":
            out[name] = {**section, **out[name]}
    router = out["router"]
    if isinstance(router, dict):
        router = dict(router)
        gar = router.pop("gar", None)
        if gar is not None and isinstance(out["train"], dict):
            out["train"] = {**out["train"], "gar": gar}
        kind = router.get("type", DEFAULT_CONFIG["router"]["type"])
        known = isinstance(kind, str) and kind in ROUTERS  # a router this release no longer has: as written
        defaults = {f.name: f.default for f in fields(config_class(kind))} if known else {}
        out["router"] = {"type": kind, **defaults, **router}
    return checkpoint.as_saved(out)
