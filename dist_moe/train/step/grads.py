"""Gradient collectives of a training step: data-parallel sums of replicated parameters, one
global-norm clip across ranks, and one agreed finiteness check.

Rank-local parameters (a rank's experts) are named by ``local_ids``: their gradients already hold
every rank's tokens, so they are not summed, but their squares enter the global norm on every rank.
"""
from __future__ import annotations

import torch

from dist_moe.distributed.reductions import all_reduce_sum, group_size

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


def sum_replicated_grads(params, local_ids: set[int], group, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Data-parallel gradient sum of the parameters every rank holds (not those in ``local_ids``),
    flattened into buckets of about ``bucket_bytes``: one all-reduce per bucket, not per parameter."""
    replicated = [p for p in params if id(p) not in local_ids]
    for p in replicated:
        if p.grad is None:  # still take part: every rank reduces every replicated parameter
            p.grad = torch.zeros_like(p)
    bucket, size = [], 0
    for i, p in enumerate(replicated):
        bucket.append(p)
        size += p.grad.numel() * p.grad.element_size()
        last = i + 1 == len(replicated)
        if last or size >= bucket_bytes or (replicated[i + 1].grad.dtype, replicated[i + 1].grad.device) != (
                p.grad.dtype, p.grad.device):
            flat = all_reduce_sum(torch.cat([q.grad.reshape(-1) for q in bucket]), group)
            for q, part in zip(bucket, flat.split([q.grad.numel() for q in bucket])):
                q.grad.copy_(part.view_as(q.grad))
            bucket, size = [], 0


def global_norm(params, local_ids: set[int], group, loss: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient norm over every rank's gradients, a scalar on their device (no host read, no fp64
    copy): per-tensor norms in one foreach call, rank-local parameters' squares summed over ranks.
    A non-finite ``loss`` (or gradient) on any rank makes it non-finite on every rank: the check rides
    in the same all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else (loss.device if loss is not None else None)

    def squares(gs):
        return torch.stack(torch._foreach_norm(gs)).float().square().sum() if gs else torch.zeros((), device=device)

    local = squares([p.grad for p in params if p.grad is not None and id(p) in local_ids])
    if loss is not None:
        local = local + loss.detach().float().sum() * 0.0  # NaN when the loss is NaN or Inf
    replicated = squares([p.grad for p in params if p.grad is not None and id(p) not in local_ids])
    return (replicated + all_reduce_sum(local, group)).sqrt()


def clip_to(params, total: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient by min(1, max_norm / total) on the device, as torch's clip_grad_norm_ does."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp(max=1.0))


def clip_global(params, local_ids: set[int], group, max_norm: float) -> float:
    """One global-norm clip over all parameters; rank-local parameters' squares are summed over ranks.
    Returns the norm before clipping."""
    total = global_norm(params, local_ids, group)
    clip_to(params, total, max_norm)
    return float(total)


def all_finite(loss: torch.Tensor, params, group) -> bool:
    """Whether the loss and every gradient are finite on every rank: one stacked check on the
    device, one agreed answer, one host read."""
    checks = [torch.isfinite(loss.detach()).all()] + [torch.isfinite(p.grad).all() for p in params
                                                      if p.grad is not None]
    bad = (~torch.stack(checks).all()).float().reshape(1)
    return float(all_reduce_sum(bad, group)) == 0.0


def scale_grads(params, factor: float) -> None:
    """Multiply every gradient in place (a data-parallel average divides by the world)."""
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)


__all__ = ["BUCKET_BYTES", "all_finite", "clip_global", "clip_to", "global_norm", "group_size", "scale_grads",
           "sum_replicated_grads"]
