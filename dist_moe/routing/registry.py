"""build_router(cfg) -> Router, with strict validation of every key.

cfg["type"] picks the strategy; every other key must be a constructor argument of that strategy:
its typed config (``config_class``) is derived from the constructor's signature, so a new
constructor parameter is a new config key with nothing else to write. Unknown keys, missing
required keys and values of the wrong type raise ValueError naming the key. The key "gar" (GAR's
settings, since moved to a training config's ``train.gar``) is still checked, with a deprecation
warning, until release ``DEPRECATED_KEYS_REMOVED_IN``; the router itself does not use it.
"""
from __future__ import annotations

import functools
import inspect
import re
import warnings
from dataclasses import dataclass, field, make_dataclass, replace
from dataclasses import fields as dataclass_fields
from typing import ClassVar

from dist_moe.config.choices import DEPRECATED_KEYS_REMOVED_IN
from dist_moe.config.types import fits, hints, wanted
from dist_moe.errors import did_you_mean, shown
from dist_moe.routing.base import Router, check_shape
from dist_moe.routing.branch import BranchRouter
from dist_moe.routing.flat import DeepSeekV3Router, HashRouter, SkyworkRouter, SwitchRouter, UniformRouter
from dist_moe.routing.gar import GARConfig
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


def fields(config) -> tuple:
    """``dataclasses.fields`` of a strategy's config (or its class): dataclasses made per strategy
    (``config_class``), which the type checker cannot see as such."""
    return dataclass_fields(config)


class RouterConfig:
    """A router's typed config. ``config_class(kind)`` derives one dataclass per strategy from its
    constructor: a field per parameter (``stats_group``, a process group, never comes from a
    config), typed by its annotation and defaulted by its default; a required parameter defaults
    to None until it is given (a training config's layer and data give ``hidden_size`` and
    SpecDrop's ``num_categories``). ``router_config(dict)`` parses and checks one."""

    type: ClassVar[str]
    num_experts: int  # every strategy's (a field of each strategy's dataclass)

    def to_dict(self, full: bool = False) -> dict:
        """``type`` and the keys that differ from the constructor's defaults (``full``: every key)."""
        defaults = _defaults(self.type)
        return {"type": self.type, **{f.name: getattr(self, f.name) for f in fields(self)
                                      if full or getattr(self, f.name) != defaults[f.name]}}

    def kwargs(self) -> dict:
        """The constructor's arguments (a required key still unset is left out: the constructor names it)."""
        required = _required(self.type)
        return {f.name: getattr(self, f.name) for f in fields(self)
                if not (f.name in required and getattr(self, f.name) is None)}

    def given(self, **keys) -> RouterConfig:
        """This config with keys its host knows (``hidden_size``): a key already set to another value is refused."""
        for key, value in keys.items():
            old = getattr(self, key, None)
            if old is not None and old != value:
                raise RouterKeyError(f"router key {key!r} is {old!r} but its host gives {value!r}", key)
        changed = {k: v for k, v in keys.items() if hasattr(self, k)}
        return replace(self, **changed)  # type: ignore[type-var]  # a per-strategy dataclass

    def missing(self, given_later=()) -> str | None:
        return next((k for k in _required(self.type) if getattr(self, k) is None and k not in given_later), None)


@functools.cache
def config_class(kind: str) -> type[RouterConfig]:
    """The typed config of router ``kind``, derived from its constructor's signature."""
    accepted = _accepted(ROUTERS[kind])
    specs = []
    for name, (param, hint) in accepted.items():
        default = None if param.default is inspect.Parameter.empty else param.default
        specs.append((name, hint, field(default=default)))
    cls = make_dataclass(f"{ROUTERS[kind].__name__}Config", specs, bases=(RouterConfig,), frozen=True,
                         namespace={"type": kind, "__module__": __name__})
    return cls


def _defaults(kind: str) -> dict:
    return {f.name: f.default for f in fields(config_class(kind))}


@functools.cache
def _required(kind: str) -> tuple:
    return tuple(n for n, (p, _) in _accepted(ROUTERS[kind]).items() if p.default is inspect.Parameter.empty)


def _accepted(cls) -> dict[str, tuple[inspect.Parameter, object]]:
    """Constructor parameter -> (the parameter, its type hint), through the class's bases up to Router;
    the first class that names a parameter gives its default and, when annotated, its type."""
    params: dict = {}
    for klass in cls.__mro__:
        if klass is Router:
            break
        types = hints(klass.__init__)
        for name, p in inspect.signature(klass.__init__).parameters.items():
            if name in ("self", "stats_group") or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            old = params.get(name)
            params[name] = (old[0] if old else p, old[1] if old and old[1] is not None else types.get(name))
    return params


def accepted_keys(kind: str) -> set[str]:
    """Config keys router ``kind`` takes (besides 'type' and 'gar')."""
    return {f.name for f in fields(config_class(kind))}


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
        msg = msg.replace("(did you mean '", f"(did you mean '{section}.")  # the suggestion names a key beside it
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


def router_config(cfg: dict | RouterConfig, given_later=(), where: str = "router key 'gar'") -> RouterConfig:
    """The typed config of a router dict, every key checked (its type from the constructor's annotation);
    the required keys ``given_later`` may be missing. A dict's deprecated ``gar`` block is checked and
    dropped with a warning: GAR's settings are a training config's ``train.gar``."""
    config = cfg if isinstance(cfg, RouterConfig) else _parse(cfg, where)
    missing = config.missing(given_later)
    if missing:
        raise RouterKeyError(f"router type {config.type!r} requires key {missing!r}", missing)
    return config


def _parse(cfg, where: str) -> RouterConfig:
    if not isinstance(cfg, dict):
        raise ValueError(f"router config must be a dict, got {type(cfg).__name__}")
    cfg = dict(cfg)
    kind = cfg.pop("type", None)
    if kind not in ROUTERS:
        raise RouterKeyError(f"router key 'type' must be one of {sorted(ROUTERS)}, got {shown(kind)}", "type")
    if "gar" in cfg:
        try:
            GARConfig.for_router(cfg.pop("gar"), kind, where)
        except ValueError as e:
            raise RouterKeyError(str(e), "gar") from None
        warnings.warn(GAR_MOVED, FutureWarning, stacklevel=4)
    cls = config_class(kind)
    allowed = {f.name: f for f in fields(cls)}
    unknown = sorted(set(cfg) - set(allowed), key=str)
    if unknown:
        raise RouterKeyError(f"unknown router key {shown(unknown[0])} for type {kind!r}"
                             f"{did_you_mean(unknown[0], allowed)}; valid keys: {sorted(allowed)}", str(unknown[0]))
    required = _required(kind)
    for key, value in cfg.items():
        hint = allowed[key].type
        if not (value is None and key in required) and not fits(value, hint):
            raise RouterKeyError(f"router key {key!r} must be {wanted(hint)}, got {shown(value)}", key)
    return cls(**cfg)


@dataclass(frozen=True)
class RouterShape:
    """What a host sizes its layer by, read from a router config without building the router."""

    num_experts: int
    top_k: int
    aux_loss_coeff: float


def router_shape(cfg: dict | RouterConfig, given_later=()) -> RouterShape:
    """The expert count, top-k and aux-loss coefficient ``build_router(cfg)`` would give, validated the
    same way (placement and engine configs need them before the one build, inside the layer). A training
    config's router lacks the keys its layer and data give it (``given_later``: hidden_size, num_categories)."""
    config = router_config(cfg, given_later)
    num_experts, top_k = config.num_experts, getattr(config, "top_k", None)
    try:
        num_experts, top_k = check_shape(num_experts, num_experts if top_k is None else top_k)  # None: dense
    except ValueError as e:
        raise _keyed(e, ("num_experts", "top_k")) from None
    return RouterShape(num_experts, top_k, float(getattr(config, "aux_loss_coeff", 0.0) or 0.0))


def layer_router(config, hidden_size: int, stats_group=None) -> Router:
    """The router a layer of ``hidden_size`` builds from a strategy's config (a dict or ``RouterConfig``
    without its hidden size, which is the layer's to give); ``stats_group``: where its statistics sum."""
    return build_router(router_config(config, ("hidden_size",)).given(hidden_size=hidden_size), stats_group=stats_group)


def build_router(cfg: dict | RouterConfig, stats_group=None) -> Router:
    """The router ``cfg`` describes (a dict, as ``build_router`` takes it, or a ``RouterConfig``); a bad key
    raises ValueError naming it (a RouterKeyError when the message names one key)."""
    config = router_config(cfg)
    kwargs = config.kwargs()
    if _takes_stats_group(config.type):
        kwargs["stats_group"] = stats_group
    try:
        return ROUTERS[config.type](**kwargs)
    except ValueError as e:
        raise _keyed(e, accepted_keys(config.type)) from None


@functools.cache
def _takes_stats_group(kind: str) -> bool:
    """Whether router ``kind`` reduces its statistics over a group (a learned or anchored router)."""
    return any("stats_group" in inspect.signature(vars(klass).get("__init__", klass)).parameters
               for klass in ROUTERS[kind].__mro__[:ROUTERS[kind].__mro__.index(Router)])


GAR_MOVED = ("GAR's settings under the router (config key 'router.gar', router key 'gar') are deprecated and "
             f"refused from release {DEPRECATED_KEYS_REMOVED_IN}: put them under train.gar")
