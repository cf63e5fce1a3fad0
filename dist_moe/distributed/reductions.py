"""Reductions for routing statistics (BRANCH anchor sums, DeepSeek-V3 loads) and GAR observations.

Routers call this instead of torch.distributed so that the strategies stay pure
tensor math; with ``group=None`` (or no initialised process group) it is the
identity.

A tensor handed to these helpers may live on any device: NCCL takes CUDA tensors only, so
on an NCCL group a CPU tensor (a trainer's scalar, a count) is reduced on this process's GPU
and comes back where it was.

Sums that feed a differentiable statistic (BRANCH's training-time anchor) go
through ``_AllReduceSum``: its backward all-reduces the incoming gradient, so
that after data-parallel gradient summation every rank holds the gradient of the
global batch's loss (each rank's loss depends on every rank's partial sums).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dist_moe.distributed.groups import strong, weak


def group_device(group) -> torch.device:
    """Where ``group``'s collectives take their tensors: this process's GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_copy(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """An all-reduced copy of ``t``, reduced on the group's device and returned on ``t``'s."""
    out = t.to(group_device(group), copy=True)  # a copy: the collective writes in place
    dist.all_reduce(out, op=op, group=group)
    return out.to(t.device)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.group = weak(group)
        return reduce_copy(t, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_copy(grad.contiguous(), strong(ctx.group, "a statistic's backward")), None


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over ``group``, differentiable when ``t`` requires grad; the identity without a group."""
    if not _active(group):
        return t
    if t.requires_grad:
        return _AllReduceSum.apply(t, group)
    return reduce_copy(t, group)


class _SummedElsewhere(torch.autograd.Function):
    """``total`` in value; the gradient goes to ``local``, summed over the group."""

    @staticmethod
    def forward(ctx, local, total, group):
        ctx.group = weak(group) if _active(group) else None
        return total.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.group is None:
            return grad, None, None
        return reduce_copy(grad.contiguous(), strong(ctx.group, "a statistic's backward")), None, None


def sum_gradient_over(local: torch.Tensor, total: torch.Tensor, group=None) -> torch.Tensor:
    """A sum over ``group`` already taken (``total``, of this rank's ``local`` and the others'), made
    differentiable in ``local`` as ``all_reduce_sum(local)`` is: its backward sums the gradient over
    the group. Several sums taken one after the other then share one all-reduce in the backward."""
    return _SummedElsewhere.apply(local, total, group)


def group_size(group) -> int:
    """Ranks in ``group``; 1 without one."""
    return 1 if not _active(group) else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank in ``group``; 0 without one."""
    return 0 if not _active(group) else dist.get_rank(group)


def _active(group) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce_sum_(t: torch.Tensor, group=None) -> None:
    """In-place sum over ``group`` of a tensor outside autograd (GAR's observations)."""
    if _active(group):
        if t.device == group_device(group):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        else:
            t.copy_(reduce_copy(t, group))


def all_gather_rows(t: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's ``t`` along dim 0 in rank order; row counts may differ."""
    if not _active(group):
        return t
    world, device = dist.get_world_size(group), group_device(group)
    n = torch.tensor([t.shape[0]], device=device)
    counts = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(counts, n, group=group)
    sizes: list[int] = torch.cat(counts).tolist()
    most = max(sizes)
    padded = t.new_zeros((most, *t.shape[1:]), device=device)
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:c] for p, c in zip(parts, sizes)]).to(t.device)


def all_reduce_max(value: int, group=None) -> int:
    """Largest ``value`` over ``group`` (e.g. one expert capacity every EP rank agrees on)."""
    if not _active(group):
        return int(value)
    return int(reduce_copy(torch.tensor([int(value)], dtype=torch.long), group, dist.ReduceOp.MAX))
