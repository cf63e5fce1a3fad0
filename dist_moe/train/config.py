"""Training configuration: an embedded default, YAML files and key=value overrides.

Every section is validated against the default's keys, so a typo fails with the
key's name instead of being ignored. Router keys are checked here as far as they can be
before the data and the layer are known (registry.router_shape), and in full by build_router.
Files are read within placement.files' limits (size, nesting, aliases, no duplicate keys).
"""
from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path

import yaml

from dist_moe.dispatch.process_group import DEVICES
from dist_moe.errors import shown
from dist_moe.experts import KINDS as EXPERT_KINDS
from dist_moe.gar.config import GARConfig
from dist_moe.integrations.megatron import DISPATCHERS
from dist_moe.routing.registry import GAR_MOVED, RouterKeyError, router_shape
from dist_moe.train.build import MODEL_KINDS
from dist_moe.train.engines import ENGINES
from dist_moe.train.rundir import output_dir
from placement.files import parse_yaml, read_yaml, yaml_problem
from placement.placement import NAMED as PLACEMENTS
from placement.plan import DEDUP_MODES


def _one_of(choices: tuple) -> tuple:
    """A rule for a key whose values the owning module lists (its message names them)."""
    return f"one of {', '.join(choices)}", lambda v: v in choices


DEFAULT_CONFIG: dict = {
    "name": "demo",
    "seed": 0,
    # which MoE layer hosts the router: dist-moe's own ("torch"), DeepSpeed's or Megatron-core's
    "engine": "torch",
    # expert parallelism over the launched world (torchrun / deepspeed launcher; 1 process: local)
    # timeout_s: how long any collective may wait for a peer before every rank stops with an error
    # device: auto (this process's GPU when one is visible, else the CPU), cpu or cuda; the backend follows
    # pipeline_chunks: C > 1 cuts each exchange into C token chunks in flight while experts run; it and dedup
    # apply to dist-moe's dispatcher: engine torch, or megatron / deepspeed through megatron_dispatcher /
    # deepspeed_dispatcher dist_moe. auto (their default): dist_moe when dedup is node or pipeline_chunks > 1,
    # else the engine's own (alltoall / deepspeed), which sends one copy per selected expert
    "parallel": {"placement": "contiguous", "dedup": "rank", "megatron_dispatcher": "auto",
                 "deepspeed_dispatcher": "auto", "timeout_s": 300.0, "device": "auto", "pipeline_chunks": 1},
    # categories: a coarse label per row (data.CATEGORY_SETS), required by specdrop routing
    # name "corpus": the multi-domain byte corpus (dist_moe/data/corpus.py) for model.kind lm, with seq_len and
    # per_domain sequences; categories "domains" makes each sequence's domain its category.
    # name "text_tasks": the multi-task text mixture (dist_moe/data/text_tasks.py) for model.kind text: per_domain
    # examples per task, seq_len MiniLM tokens each; the task is each example's category
    "data": {"name": "magic", "val_fraction": 0.2, "max_rows": None, "categories": None, "seq_len": 64,
             "per_domain": 2000},
    # label_mask: mask the logits of classes outside the row's category (SpecDrop's dense control)
    # kind: "tabular" (one MoE block between input and head), "image" (conv stem, then the same; for
    # data.name fashion_mnist), "lm" (tiny transformer, MoE FFN per layer; for data.name corpus) or
    # "text" (frozen MiniLM states, LoRA-expert MoE, a head per task; for data.name text_tasks)
    "model": {"kind": "tabular", "ffn_hidden_size": 32, "d_model": 0, "capacity_factor": 1.25,
              "expert_type": "swiglu", "post_norm": False, "label_mask": False, "layers": 2, "heads": 4},
    # BRANCH paper setup: E=16 SwiGLU experts, top-4, capacity factor 1.25, Adam lr 1e-3.
    "router": {"type": "branch", "num_experts": 16, "top_k": 4, "node_map": "linear"},
    # max_steps, when set, is the run's length in optimizer steps instead of epochs
    # schedule: how often a scheduled router (SpecDrop) advances, every "step" or every "epoch"
    "train": {"epochs": 20, "batch_size": 256, "lr": 1e-3, "max_grad_norm": 1.0, "log_every": 10,
              "max_steps": None, "gar_group_size": 32, "schedule": "step",
              # gar: GAR's settings {lambda, eps, mode, unit} (dist_moe/gar/config.py; null: no GAR);
              # gar_groups: GAR observation groups of consecutive rows, or of one category (task) each
              "gar": None, "gar_groups": "consecutive",
              # checkpoint_every: steps between DCP checkpoints under output.dir/checkpoints (null: none);
              # resume: continue from the newest one there (none yet: start afresh)
              "checkpoint_every": None, "resume": False,
              # a step whose loss or gradients are not finite is skipped (no update, router state restored);
              # the run stops once more than max_skipped_steps have been skipped
              "max_skipped_steps": 10},
    # tensorboard: also write TensorBoard scalars to <dir>/tensorboard (needs the tensorboard package)
    # {name}: the config's name, plus any model-changing overrides of this run (+router.top_k=2); ~ expands
    # overwrite: a dir that already holds a run is refused unless train.resume continues it or this is true,
    # which removes that run's files first (dist-moe's own only: rundir.RUN_FILES and RUN_DIRS)
    "output": {"dir": "runs/{name}", "tensorboard": False, "overwrite": False},
}
_OPEN_SECTIONS = {"router", "train.gar"}  # free-form here, checked by build_router and GARConfig

_POSITIVE = ("a positive int", lambda v: v >= 1)
MAX_TIMEOUT_S = 7 * 24 * 3600
# key -> (type, may be None, (description, predicate) or None)
_RULES = {
    # the name is a directory under runs/: no separator or '..' may take it elsewhere
    "name": (str, False, ("a non-empty name without '/', '\\' or '..'",
                          lambda v: bool(v.strip()) and not any(c in v for c in ("/", "\\", "..", "\0")))),
    "seed": (int, False, ("an int in [0, 2**63 - 1]", lambda v: 0 <= v < 2**63)),
    "engine": (str, False, _one_of(ENGINES)),
    "parallel.placement": (str, False, (f"one of {', '.join(PLACEMENTS)} or a placement .yaml (dist-moe place --out)",
                                        lambda v: v in PLACEMENTS or v.endswith((".yaml", ".yml")))),
    "parallel.dedup": (str, False, _one_of(DEDUP_MODES)),
    "parallel.megatron_dispatcher": (str, False, _one_of(("auto", *DISPATCHERS, "dist_moe"))),
    "parallel.deepspeed_dispatcher": (str, False, _one_of(("auto", "deepspeed", "dist_moe"))),
    # beyond a week a hung peer is never reported; far beyond, the backends' own timers overflow
    "parallel.timeout_s": (float, False, (f"a number of seconds in (0, {MAX_TIMEOUT_S}] (a week)",
                                          lambda v: 0 < v <= MAX_TIMEOUT_S)),
    "parallel.device": (str, False, _one_of(DEVICES)),
    "parallel.pipeline_chunks": (int, False, ("an int >= 1", lambda v: v >= 1)),
    "data.name": (str, False, None),  # the loader names the valid datasets
    "data.val_fraction": (float, False, ("a number in (0, 1)", lambda v: 0 < v < 1)),
    "data.max_rows": (int, True, ("an int >= 10", lambda v: v >= 10)),
    "data.categories": (str, True, None),  # the loader names the valid category sets
    "model.kind": (str, False, _one_of(MODEL_KINDS)),
    "model.layers": (int, False, _POSITIVE),
    "model.heads": (int, False, _POSITIVE),
    "data.seq_len": (int, False, ("an int >= 2", lambda v: v >= 2)),
    "data.per_domain": (int, False, _POSITIVE),
    "model.ffn_hidden_size": (int, False, _POSITIVE),
    "model.d_model": (int, False, ("an int >= 0 (0: no input projection)", lambda v: v >= 0)),
    "model.capacity_factor": (float, True, ("a finite number > 0", lambda v: v > 0)),
    "model.expert_type": (str, False, _one_of(EXPERT_KINDS)),
    "model.post_norm": (bool, False, None),
    "model.label_mask": (bool, False, None),
    "train.epochs": (int, False, _POSITIVE),
    "train.batch_size": (int, False, _POSITIVE),
    "train.lr": (float, False, ("a finite number > 0", lambda v: v > 0)),
    "train.max_grad_norm": (float, True, ("a finite number > 0", lambda v: v > 0)),
    "train.log_every": (int, False, _POSITIVE),
    "train.max_steps": (int, True, _POSITIVE),
    "train.gar_group_size": (int, False, _POSITIVE),
    "train.schedule": (str, False, ("'step' or 'epoch'", lambda v: v in ("step", "epoch"))),
    "train.gar_groups": (str, False, ("consecutive or same_category",
                                      lambda v: v in ("consecutive", "same_category"))),
    "train.checkpoint_every": (int, True, _POSITIVE),
    "train.max_skipped_steps": (int, False, ("an int >= 0", lambda v: v >= 0)),
    "train.resume": (bool, False, None),
    "output.dir": (str, False, ("a non-empty path", lambda v: bool(v.strip()) and "\0" not in v)),
    "output.tensorboard": (bool, False, None),
    "output.overwrite": (bool, False, None),
}


def validate(cfg: dict) -> dict:
    """Check every leaf of the training config; raise ValueError naming the key."""
    _move_router_gar(cfg, warn=True)
    for key, (kind, optional, rule) in _RULES.items():
        section, _, leaf = key.rpartition(".")
        value = (cfg[section] if section else cfg)[leaf]
        if value is None and optional:
            continue
        ok_type = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float:  # NaN and inf pass every comparison a rule could make: refused for every key
            ok_type = isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
        if not ok_type or (rule is not None and not rule[1](value)):
            want = rule[0] if rule else kind.__name__
            raise ValueError(f"config key {key!r} must be {want}{' or null' if optional else ''}, got {shown(value)}")
    try:
        cfg["output"]["dir"].format(name=cfg["name"])
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"config key 'output.dir' may use only {{name}}, got {shown(cfg['output']['dir'])} ({e})")
    output_dir(cfg)  # a ~user that does not exist
    if cfg["train"]["resume"] and cfg["output"]["overwrite"]:
        raise ValueError("train.resume=true continues the run in output.dir and output.overwrite=true removes it: "
                         "set one of them")
    if not isinstance(cfg["router"], dict) or "type" not in cfg["router"]:
        raise ValueError("config key 'router' must be a mapping with a 'type'")
    try:  # what can be checked before the data and the layer give the router the rest
        router_shape(cfg["router"], given_later=("hidden_size", "num_categories"))
    except RouterKeyError as e:
        raise e.under("router") from None
    if cfg["train"]["gar"] is not None:
        GARConfig.for_router(cfg["train"]["gar"], cfg["router"]["type"])
    _check_engine_dispatch(cfg)
    return cfg


def _check_engine_dispatch(cfg: dict) -> None:
    """Before any process group exists: what only dist-moe's dispatcher does, refused when the config
    names the engine's own (it would be silently ignored); dist-moe's dispatcher in an engine is dropless."""
    engine = cfg["engine"]
    if engine == "torch":
        return
    key = f"parallel.{engine}_dispatcher"
    if ENGINES[engine].dispatches(cfg["parallel"]):
        if cfg["model"]["capacity_factor"] is not None:
            raise ValueError(f"engine {engine} through dist-moe's dispatcher ({key}: "
                             f"{cfg['parallel'][f'{engine}_dispatcher']}, with parallel.dedup="
                             f"{cfg['parallel']['dedup']}, "
                             f"parallel.pipeline_chunks={cfg['parallel']['pipeline_chunks']}) "
                             f"runs dropless: set model.capacity_factor: null (got {cfg['model']['capacity_factor']})")
        return
    chunks, dedup = cfg["parallel"]["pipeline_chunks"], cfg["parallel"]["dedup"]
    if chunks != 1:
        raise ValueError(f"parallel.pipeline_chunks={chunks} pipelines dist-moe's own dispatcher ({key}: dist_moe "
                         f"or auto); {key}: {cfg['parallel'][f'{engine}_dispatcher']} exchanges through the engine's "
                         "own: set it to 1")
    if dedup == "node":  # the engines' own dispatchers send one copy per (token, expert)
        raise ValueError(f"parallel.dedup=node is dist-moe's dispatcher's ({key}: dist_moe or auto); {key}: "
                         f"{cfg['parallel'][f'{engine}_dispatcher']} sends one copy per (token, expert)")


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an int beyond any float
        return False


def _move_router_gar(cfg: dict, warn: bool) -> None:
    """GAR's settings moved from ``router.gar`` to ``train.gar``: the old key still works, for one
    release, with a warning naming the new one."""
    router, train = cfg.get("router"), cfg.setdefault("train", {})
    if not isinstance(router, dict) or "gar" not in router:
        return
    if train.get("gar") is not None:
        raise ValueError("config keys 'router.gar' and 'train.gar' are both set: keep train.gar "
                         "(router.gar is its deprecated name)")
    train["gar"] = router.pop("gar")
    if warn:
        warnings.warn(GAR_MOVED, FutureWarning, stacklevel=3)


def _merge(base: dict, update: dict, path: str = "") -> dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        where = f"{path}{key}"
        if path.rstrip(".") in _OPEN_SECTIONS:
            # router.subtree_limit.node=2 updates one level of a mapping, it does not drop the others
            out[key] = _merge_open(out.get(key), value)
            continue
        if key not in base:
            raise ValueError(f"unknown config key {shown(where)}; valid keys here: {sorted(base)}")
        if isinstance(base[key], dict):
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
    from dist_moe.routing.registry import ROUTERS, accepted_keys

    if new["type"] not in ROUTERS:
        return dict(new)  # build_router names the bad type
    keep = accepted_keys(new["type"])
    return {"type": new["type"], **{k: v for k, v in old.items() if k in keep}}


def parse_override(item: str) -> dict:
    """'train.lr=3e-4' -> {'train': {'lr': 0.0003}} (values parsed as YAML)."""
    if "=" not in item:
        raise ValueError(f"override {shown(item)} must look like key.sub=value")
    key, raw = item.split("=", 1)
    try:
        value = parse_yaml(raw) if raw else None
    except yaml.YAMLError as e:
        raise ValueError(f"override {shown(item)}: the value is not valid YAML ({yaml_problem(e)})") from None
    nested: dict = value
    for part in reversed(key.strip().split(".")):
        if not part:
            raise ValueError(f"override {shown(item)} has an empty key component")
        nested = {part: nested}
    return nested


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> dict:
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    if path is not None:
        loaded = read_yaml(path, "config")
        loaded = {} if loaded is None else loaded
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping")
        cfg = _merge(cfg, loaded)
    for item in overrides:
        cfg = _merge(cfg, parse_override(item))
    cfg["name"] = run_name(cfg["name"], overrides)
    return validate(cfg)


def run_name(name: str, overrides) -> str:
    """``name`` plus the overrides that change the model, its data or its engine (``+router.variant=uniform``), so
    that a control run gets an output directory of its own instead of overwriting the config's run;
    unchanged when the overrides set ``name`` or ``output.dir`` themselves."""
    keys = [item.split("=", 1)[0].strip() for item in overrides]
    if any(k == "name" or k.startswith("output.") for k in keys):
        return name
    named = (*MODEL_SECTIONS, "seed", "engine")
    tags = [item.strip() for item, k in zip(overrides, keys)
            if k.split(".")[0] in named or k.split(".")[:2] == ["train", "gar"]]
    return name + "".join("+" + t.replace("/", "_").replace("\\", "_").replace("..", "_").replace(" ", "")
                          for t in tags)


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


def model_changes(saved: dict, cfg: dict) -> list[tuple[str, object, object]]:
    """(key, checkpoint's value, this run's value) for every model-making key that differs, plus ``seed``
    (it orders the data the saved position counts into)."""
    saved = copy.deepcopy(saved)
    _move_router_gar(saved, warn=False)  # a checkpoint from before the move resumes as it was saved
    old = _leaves({k: saved.get(k, {}) for k in MODEL_SECTIONS} | {"seed": saved.get("seed")})
    new = _leaves({k: cfg.get(k, {}) for k in MODEL_SECTIONS} | {"seed": cfg.get("seed")})
    return [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
