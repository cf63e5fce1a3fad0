"""Reductions for routing statistics (BRANCH anchor sums, DeepSeek-V3 loads) and GAR observations.

Routers call this instead of torch.distributed so that the strategies stay pure
tensor math; with ``group=None`` (or no initialised process group) it is the
identity.

Sums that feed a differentiable statistic (BRANCH's training-time anchor) go
through ``_AllReduceSum``: its backward all-reduces the incoming gradient, so
that after data-parallel gradient summation every rank holds the gradient of the
global batch's loss (each rank's loss depends on every rank's partial sums).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over ``group``, differentiable when ``t`` requires grad; the identity without a group."""
    if not _active(group):
        return t
    if t.requires_grad:
        return _AllReduceSum.apply(t, group)
    out = t.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _active(group) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce_sum_(t: torch.Tensor, group=None) -> None:
    """In-place sum over ``group`` of a tensor outside autograd (GAR's observations)."""
    if _active(group):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def all_gather_rows(t: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's ``t`` along dim 0 in rank order; row counts may differ."""
    if not _active(group):
        return t
    world = dist.get_world_size(group)
    n = torch.tensor([t.shape[0]], device=t.device)
    counts = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(counts, n, group=group)
    counts = [int(c) for c in counts]
    most = max(counts)
    padded = t.new_zeros((most,) + tuple(t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:c] for p, c in zip(parts, counts)])


def all_reduce_max(value: int, group=None) -> int:
    """Largest ``value`` over ``group`` (e.g. one expert capacity every EP rank agrees on)."""
    if not _active(group):
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)
