"""What a typed config field accepts, read from its annotation: the one value check that the run
config's sections (``train/run_config.py``), the router configs derived from the routers'
constructors (``routing/registry.py``) and GAR's settings share.

``int`` refuses bools and floats, ``float`` any non-finite number (NaN and inf pass every range
check a rule could make), ``X | None`` also None; an unannotated parameter accepts anything.
"""
from __future__ import annotations

import math
import numbers
import types
import typing

_WANTS = {int: "an int", float: "a finite number", str: "a string", bool: "true or false", dict: "a mapping",
          list: "a list"}


def _finite(value) -> bool:
    try:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return False


def _fits_one(value, kind) -> bool:
    if kind is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind is float:
        return _finite(value)
    if kind in _WANTS:
        return isinstance(value, kind)
    return True  # a type this module does not check (a tensor, a process group): the constructor does


def kinds(hint) -> tuple:
    """The types a hint allows, None included as ``type(None)``; () for no annotation."""
    if hint is None or hint is typing.Any:
        return ()
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (typing.get_origin(hint) or hint,)


def optional(hint) -> bool:
    return type(None) in kinds(hint)


def fits(value, hint) -> bool:
    allowed = kinds(hint)
    if not allowed:
        return True
    if value is None:
        return type(None) in allowed
    return any(_fits_one(value, k) for k in allowed if k is not type(None))


def wanted(hint) -> str:
    """``'an int or a mapping'`` for ``int | dict | None`` (None is added by the caller's message)."""
    return " or ".join(_WANTS.get(k, getattr(k, "__name__", str(k))) for k in kinds(hint) if k is not type(None))


def hints(function) -> dict:
    """``typing.get_type_hints``, with the annotations of ``from __future__ import annotations`` evaluated."""
    return typing.get_type_hints(function)
