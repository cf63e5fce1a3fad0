"""All-reduce of small routing statistics (BRANCH anchor sums, DeepSeek-V3 loads).

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
    if group is None or not dist.is_available() or not dist.is_initialized():
        return t
    if dist.get_world_size(group) == 1:
        return t
    if t.requires_grad:
        return _AllReduceSum.apply(t, group)
    out = t.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out
