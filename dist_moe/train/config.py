"""Training configuration: an embedded default, YAML files and key=value overrides.

Every section is validated against the default's keys, so a typo fails with the
key's name instead of being ignored. Router keys are validated by build_router.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import yaml


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads '3e-4' as a string; accept it as a float like every ML config does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."),
)


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)

DEFAULT_CONFIG: dict = {
    "name": "demo",
    "seed": 0,
    "data": {"name": "magic", "val_fraction": 0.2, "max_rows": None},
    "model": {"ffn_hidden_size": 32, "d_model": 0, "capacity_factor": 1.25, "expert_type": "swiglu",
              "post_norm": False},
    # BRANCH paper setup: E=16 SwiGLU experts, top-4, capacity factor 1.25, Adam lr 1e-3.
    "router": {"type": "branch", "num_experts": 16, "top_k": 4, "node_map": "linear"},
    "train": {"epochs": 20, "batch_size": 256, "lr": 1e-3, "max_grad_norm": 1.0, "log_every": 10,
              "max_steps": None, "gar_group_size": 32},
    "output": {"dir": "runs/{name}"},
}
_OPEN_SECTIONS = {"router"}  # free-form here, checked by build_router


def _merge(base: dict, update: dict, path: str = "") -> dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        where = f"{path}{key}"
        if path.rstrip(".") in _OPEN_SECTIONS:
            out[key] = value
            continue
        if key not in base:
            raise ValueError(f"unknown config key {where!r}; valid keys here: {sorted(base)}")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ValueError(f"config key {where!r} must be a mapping, got {value!r}")
            if key in _OPEN_SECTIONS and "type" in value and value["type"] != base[key].get("type"):
                out[key] = copy.deepcopy(value)  # a new router type starts from its own defaults
                continue
            out[key] = _merge(base[key], value, where + ".")
        else:
            out[key] = value
    return out


def parse_override(item: str) -> dict:
    """'train.lr=3e-4' -> {'train': {'lr': 0.0003}} (values parsed as YAML)."""
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like key.sub=value")
    key, raw = item.split("=", 1)
    value = _yaml(raw) if raw else None
    nested: dict = value
    for part in reversed(key.strip().split(".")):
        if not part:
            raise ValueError(f"override {item!r} has an empty key component")
        nested = {part: nested}
    return nested


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> dict:
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ValueError(f"config file {str(path)!r} does not exist")
        loaded = _yaml(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping")
        cfg = _merge(cfg, loaded)
    for item in overrides:
        cfg = _merge(cfg, parse_override(item))
    return cfg
