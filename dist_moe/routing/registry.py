"""build_router(cfg) -> Router, with strict validation of every key.

cfg["type"] picks the strategy; every other key must be a constructor argument
of that strategy. Unknown keys, missing required keys and values of the wrong type
raise ValueError naming the key. The key "gar" (GAR's settings, since moved to a training
config's ``train.gar``) is still read, with a deprecation warning, until the next release.
"""
from __future__ import annotations

import inspect
import math
import numbers
import re
import warnings
from dataclasses import dataclass

from dist_moe.errors import shown
from dist_moe.gar.config import GARConfig
from dist_moe.routing.base import Router, check_shape
from dist_moe.routing.branch import BranchRouter
from dist_moe.routing.flat import DeepSeekV3Router, HashRouter, SkyworkRouter, SwitchRouter, UniformRouter
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
    "balance_rate", "p_assigned", "p_leak", "warmup_fraction", "imbalance_beta",
}
_STR_KEYS = {"node_map", "score_func", "variant", "subtree_balance"}
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


class RouterKeyError(ValueError):
    """A bad router key. ``str(e)`` names the key as ``build_router``'s callers pass it (``num_experts``);
    ``e.under("router")`` is the same error naming it as a training config does (``router.num_experts``)."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key

    def under(self, section: str) -> ValueError:
        msg, key, full = str(self), self.key, f"{section}.{self.key}"
        if f"router key {key!r}" in msg:
            msg = msg.replace(f"router key {key!r}", f"config key {full!r}")
        elif re.match(rf"{key}\b", msg):
            msg = full + msg[len(key):]
        else:
            msg = msg.replace(f"key {key!r}", f"key {full!r}")
        return ValueError(msg)


def _keyed(e: ValueError, keys) -> ValueError:
    """``e`` as a RouterKeyError when its message names one of ``keys`` the way router messages do:
    first (``top_k must be ...``) or as ``router key 'top_k'``."""
    if isinstance(e, RouterKeyError):
        return e
    msg = str(e)
    m = re.match(r"(\w+)\b", msg)
    key = m.group(1) if m and m.group(1) in keys else next((k for k in keys if f"router key {k!r}" in msg), None)
    return e if key is None else RouterKeyError(msg, key)


def _finite(value) -> bool:
    try:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return False


def _check_type(key: str, value) -> None:
    if value is None:
        return
    if key in _INT_KEYS and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise RouterKeyError(f"router key {key!r} must be an int, got {shown(value)}", key)
    # NaN and inf pass the constructors' range checks (inf > 0): refused here for every number key
    if key in _FLOAT_KEYS and not _finite(value):
        raise RouterKeyError(f"router key {key!r} must be a finite number, got {shown(value)}", key)
    if key in _STR_KEYS and not isinstance(value, str):
        raise RouterKeyError(f"router key {key!r} must be a string, got {shown(value)}", key)
    if key in _BOOL_KEYS and not isinstance(value, bool):
        raise RouterKeyError(f"router key {key!r} must be true or false, got {shown(value)}", key)


def _checked(cfg: dict, given_later=()) -> tuple[str, dict, dict, object]:
    """(type, accepted parameters, constructor arguments, the deprecated gar block) of a validated config;
    the required keys ``given_later`` may be missing."""
    if not isinstance(cfg, dict):
        raise ValueError(f"router config must be a dict, got {type(cfg).__name__}")
    cfg = dict(cfg)
    kind = cfg.pop("type", None)
    if kind not in ROUTERS:
        raise RouterKeyError(f"router key 'type' must be one of {sorted(ROUTERS)}, got {shown(kind)}", "type")
    accepted = _accepted(ROUTERS[kind])
    gar = cfg.pop("gar", None)
    allowed = set(accepted) - {"stats_group"}  # a process group, never from YAML
    unknown = sorted(set(cfg) - allowed)
    if unknown:
        raise RouterKeyError(f"unknown router key {shown(unknown[0])} for type {kind!r}; valid keys: "
                             f"{sorted(allowed)}", str(unknown[0]))
    missing = [n for n, p in accepted.items() if p.default is inspect.Parameter.empty and n not in cfg
               and n not in given_later]
    if missing:
        raise RouterKeyError(f"router type {kind!r} requires key {missing[0]!r}", missing[0])
    for key, value in cfg.items():
        _check_type(key, value)
    return kind, accepted, cfg, gar


@dataclass(frozen=True)
class RouterShape:
    """What a host sizes its layer by, read from a router config without building the router."""

    num_experts: int
    top_k: int
    aux_loss_coeff: float


def router_shape(cfg: dict, given_later=()) -> RouterShape:
    """The expert count, top-k and aux-loss coefficient ``build_router(cfg)`` would give, validated the
    same way (placement and engine configs need them before the one build, inside the layer). A training
    config's router lacks the keys its layer and data give it (``given_later``: hidden_size, num_categories)."""
    _, accepted, kwargs, _ = _checked(cfg, given_later)

    def given(name):
        default = accepted[name].default if name in accepted else None
        return kwargs.get(name, None if default is inspect.Parameter.empty else default)

    num_experts = given("num_experts")
    top_k = given("top_k")
    try:
        num_experts, top_k = check_shape(num_experts, num_experts if top_k is None else top_k)  # None: dense
    except ValueError as e:
        raise _keyed(e, ("num_experts", "top_k")) from None
    return RouterShape(num_experts, top_k, float(given("aux_loss_coeff") or 0.0))


def build_router(cfg: dict, stats_group=None) -> Router:
    """The router ``cfg`` describes; a bad key raises ValueError naming it (a RouterKeyError when the
    message names one key)."""
    kind, accepted, kwargs, gar = _checked(cfg)
    if "stats_group" in accepted:
        kwargs["stats_group"] = stats_group
    try:
        router = ROUTERS[kind](**kwargs)
        router.gar_config = None
        if gar is not None:
            router.gar_config = GARConfig.for_router(gar, kind, "router key 'gar'")
    except ValueError as e:
        raise _keyed(e, {*accepted, "gar"}) from None
    if gar is not None:
        warnings.warn(GAR_MOVED, FutureWarning, stacklevel=2)
    return router


GAR_MOVED = ("GAR's settings under the router (config key 'router.gar', router key 'gar') are deprecated and go in "
             "the next release: put them under train.gar")
