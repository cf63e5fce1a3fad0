"""An engine's expert weights cast to the compute dtype once per forward, not once per chunk.

A pipelined exchange runs the experts on every chunk as it arrives; an engine's experts (DeepSpeed's,
Megatron's, transformers') take their weights from their own parameters on each call, and under bf16
autocast each call would cast them again (F.grouped_mm is not on autocast's lists, so no cast cache
applies). Inside ``one_cast_per_forward`` the first chunk's cast is kept and the later chunks reuse it;
its backward still reaches the parameters (the cast is in every chunk's graph). dist-moe's own experts
take cast copies from the exchange instead (``pipeline.py``'s ``_weights``)."""
from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
from torch import Tensor

_CASTS: ContextVar[dict | None] = ContextVar("weight_casts", default=None)


@contextlib.contextmanager
def one_cast_per_forward():
    token = _CASTS.set({})
    try:
        yield
    finally:
        _CASTS.reset(token)


def cast_weight(w: Tensor, dtype: torch.dtype) -> Tensor:
    """``w.to(dtype)``, made once per ``one_cast_per_forward`` for the same weight (its storage, place and
    shape) in the same grad mode."""
    casts = _CASTS.get()
    if w.dtype == dtype or casts is None:
        return w.to(dtype)
    key = (w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape), tuple(w.stride()), dtype,
           torch.is_grad_enabled())
    if key not in casts:
        casts[key] = w.to(dtype)
    return casts[key]
