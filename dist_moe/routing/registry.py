"""build_router(cfg) -> Router, with strict validation of every key.

cfg["type"] picks the strategy; every other key must be a constructor argument
of that strategy. Unknown keys, missing required keys and values of the wrong type
raise ValueError naming the key. The key "gar" (GAR's settings, since moved to a training
config's ``train.gar``) is still read, with a deprecation warning, until the next release.
"""
from __future__ import annotations

import inspect
import numbers
import warnings
from dataclasses import dataclass

from dist_moe.routing.base import Router, check_shape
from dist_moe.routing.branch import BranchRouter
from dist_moe.routing.flat import DeepSeekV3Router, HashRouter, SkyworkRouter, SwitchRouter, UniformRouter
from dist_moe.gar.config import GARConfig
from dist_moe.routing.specdrop import SpecDropRouter

ROUTERS: dict[str, type[Router]] = {
    "switch": SwitchRouter,
    "deepseek_v3": DeepSeekV3Router,
    "skywork": SkyworkRouter,
    "hash": HashRouter,
    "uniform": UniformRouter,
    "branch": BranchRouter,
    "specdrop": SpecDropRouter,
}

_INT_KEYS = {"hidden_size", "num_experts", "top_k", "mlp_hidden", "num_categories", "total_steps", "seed",
             "node_limit", "subtree_depth"}
_FLOAT_KEYS = {
    "ema_decay", "eta", "aux_loss_coeff", "jitter_eps", "capacity_factor", "norm_scale", "bias_update_rate",
    "p_assigned", "p_leak", "warmup_fraction", "imbalance_beta",
}
_STR_KEYS = {"node_map", "score_func", "variant"}
_BOOL_KEYS = {"normalize_gates"}


def _accepted(cls) -> dict[str, inspect.Parameter]:
    params = {}
    for klass in cls.__mro__:
        if klass is Router:
            break
        for name, p in inspect.signature(klass.__init__).parameters.items():
            if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                params.setdefault(name, p)
    return params


def accepted_keys(kind: str) -> set[str]:
    """Config keys router ``kind`` takes (besides 'type' and 'gar')."""
    return set(_accepted(ROUTERS[kind])) - {"stats_group"}


def _check_type(key: str, value) -> None:
    if value is None:
        return
    if key in _INT_KEYS and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise ValueError(f"router key {key!r} must be an int, got {value!r}")
    if key in _FLOAT_KEYS and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise ValueError(f"router key {key!r} must be a number, got {value!r}")
    if key in _STR_KEYS and not isinstance(value, str):
        raise ValueError(f"router key {key!r} must be a string, got {value!r}")
    if key in _BOOL_KEYS and not isinstance(value, bool):
        raise ValueError(f"router key {key!r} must be true or false, got {value!r}")


def _checked(cfg: dict) -> tuple[str, dict, dict, object]:
    """(type, accepted parameters, constructor arguments, the deprecated gar block) of a validated config."""
    if not isinstance(cfg, dict):
        raise ValueError(f"router config must be a dict, got {type(cfg).__name__}")
    cfg = dict(cfg)
    kind = cfg.pop("type", None)
    if kind not in ROUTERS:
        raise ValueError(f"router key 'type' must be one of {sorted(ROUTERS)}, got {kind!r}")
    accepted = _accepted(ROUTERS[kind])
    gar = cfg.pop("gar", None)
    allowed = set(accepted) - {"stats_group"}  # a process group, never from YAML
    unknown = sorted(set(cfg) - allowed)
    if unknown:
        raise ValueError(f"unknown router key {unknown[0]!r} for type {kind!r}; valid keys: {sorted(allowed)}")
    missing = [n for n, p in accepted.items() if p.default is inspect.Parameter.empty and n not in cfg]
    if missing:
        raise ValueError(f"router type {kind!r} requires key {missing[0]!r}")
    for key, value in cfg.items():
        _check_type(key, value)
    return kind, accepted, cfg, gar


@dataclass(frozen=True)
class RouterShape:
    """What a host sizes its layer by, read from a router config without building the router."""

    num_experts: int
    top_k: int
    aux_loss_coeff: float


def router_shape(cfg: dict) -> RouterShape:
    """The expert count, top-k and aux-loss coefficient ``build_router(cfg)`` would give, validated the
    same way (placement and engine configs need them before the one build, inside the layer)."""
    _, accepted, kwargs, _ = _checked(cfg)

    def given(name):
        default = accepted[name].default if name in accepted else None
        return kwargs.get(name, None if default is inspect.Parameter.empty else default)

    num_experts = given("num_experts")
    top_k = given("top_k")
    num_experts, top_k = check_shape(num_experts, num_experts if top_k is None else top_k)  # None: dense
    return RouterShape(num_experts, top_k, float(given("aux_loss_coeff") or 0.0))


def build_router(cfg: dict, stats_group=None) -> Router:
    kind, accepted, kwargs, gar = _checked(cfg)
    if "stats_group" in accepted:
        kwargs["stats_group"] = stats_group
    router = ROUTERS[kind](**kwargs)
    router.gar_config = None
    if gar is not None:
        router.gar_config = GARConfig.for_router(gar, kind, "router key 'gar'")
        warnings.warn(GAR_MOVED, FutureWarning, stacklevel=2)
    return router


GAR_MOVED = ("GAR's settings under the router (config key 'router.gar', router key 'gar') are deprecated and go in "
             "the next release: put them under train.gar")
