"""The dtype an exchange's rows travel in: ``auto`` (the default) is the dtype the experts compute in, so
under bf16 (autocast's, DeepSpeed's, a model loaded in bf16) rows cross the link in bf16, as the engines'
own dispatchers send them; ``fp32`` and ``bf16`` name it. Gates (fp32) and routes travel as they are."""
from __future__ import annotations

import torch
from torch import Tensor

from dist_moe.config.choices import WIRE_DTYPES
from dist_moe.dispatch.apply_experts import compute_dtype

_NAMED = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_wire_dtype(name) -> str:
    if name not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}, got {name!r}")
    return name


def wire_dtype(name: str, h: Tensor) -> torch.dtype:
    """What rows like ``h`` travel in under ``name`` (``auto``: the experts' compute dtype for them)."""
    if name == "auto":
        return compute_dtype(h)
    return _NAMED[name]
