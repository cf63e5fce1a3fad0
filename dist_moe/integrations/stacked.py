"""An engine's per-expert weights seen as one stacked [E, ...] tensor, without copying them.

Megatron's SequentialMLP and DeepSpeed's expert copies hold one parameter per expert; a
grouped GEMM (``torch.nn.functional.grouped_mm``) takes all experts' weights as one 3-D
tensor. When the parameters lie in one storage at a constant stride (``stack_in_place``
lays them out so once, when the layer is built; an engine that re-homes them, as ZeRO's
flat buffers do in parameter order, may keep that), ``stacked_view`` is that tensor: a
strided view of the storage whose backward hands each parameter its own slice of the
gradient. The parameters stay the engine's own objects, names and shapes, so its
checkpoint and optimizer code sees nothing new. Where they do not lie so (a cast or a
buffer that placed them apart), ``stacked_view`` returns None and the caller loops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def stack_in_place(params: list[Tensor]) -> None:
    """Move ``params`` (same shape, dtype and device) into one new [E, ...] storage, expert by expert
    (one copy, here; the Parameter objects stay)."""
    if len(params) < 2 or _stride(params) is not None:
        return
    first = params[0]
    if any(p.shape != first.shape or p.dtype != first.dtype or p.device != first.device for p in params):
        return
    with torch.no_grad():
        stack = torch.stack([p.detach() for p in params])
        for j, p in enumerate(params):
            p.data = stack[j]


def _stride(params: list[Tensor]) -> int | None:
    """Elements between consecutive experts' parameters in one storage, or None when they are not
    laid out at one positive stride (each one contiguous, same shape and dtype)."""
    first = params[0]
    if not all(p.is_contiguous() and p.shape == first.shape and p.dtype == first.dtype for p in params):
        return None
    if len(params) == 1:
        return first.numel()
    storage = first.untyped_storage().data_ptr()
    if any(p.untyped_storage().data_ptr() != storage for p in params):
        return None
    step = params[1].storage_offset() - first.storage_offset()
    if step < first.numel():
        return None
    if any(p.storage_offset() != first.storage_offset() + j * step for j, p in enumerate(params)):
        return None
    return step


class _Stacked(torch.autograd.Function):
    """The [E, ...] view of parameters that lie at one stride; backward: each its own gradient slice."""

    @staticmethod
    def forward(ctx, step: int, *params: Tensor) -> Tensor:
        first = params[0]
        # a detached alias: no copy, and the parameters' version counter guards the saved view
        return first.detach().as_strided((len(params), *first.shape), (step, *first.stride()),
                                         first.storage_offset())

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (None, *grad.unbind(0))


def stacked_alias(params: list[Tensor]) -> Tensor | None:
    """``params`` as one [E, ...] tensor sharing their storage, outside autograd (for checks), or None."""
    step = _stride(params) if params else None
    if step is None:
        return None
    first = params[0].detach()
    return first.as_strided((len(params), *first.shape), (step, *first.stride()), first.storage_offset())


def stacked_view(params: list[Tensor]) -> Tensor | None:
    """``params`` as one differentiable [E, ...] tensor without a copy, or None where they do not lie
    at one stride in one storage (the caller then runs them one by one)."""
    step = _stride(params) if params else None
    return None if step is None else _Stacked.apply(step, *params)


def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Rows of group e (ending at ``offs[e]``) times ``w[e]`` [in, out]."""
    return F.grouped_mm(x, w, offs=offs)


class RestacksExperts:
    """Mixed into an engine's MoE layer whose ``routed_experts`` see its weights stacked: ``module.to`` and
    ``.bfloat16()`` give every parameter a storage of its own, so the layout is made again after them."""

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        self.routed_experts.restack()  # type: ignore[attr-defined]
        return out
