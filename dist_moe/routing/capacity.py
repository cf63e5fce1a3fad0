"""Expert capacity: keep at most ceil(capacity_factor * T * K / E) slots per expert.

Slots are served in priority order: every token's first choice before any
token's second choice (GShard / DeepSpeed top-2 convention), and within one
choice rank in token order. Dropped slots get expert id -1 and gate 0, so
nothing downstream computes or sends them.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from dist_moe.config.choices import MAX_CAPACITY_FACTOR


def capacity_for(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
            or not 0 < capacity_factor <= MAX_CAPACITY_FACTOR):
        raise ValueError(f"capacity_factor must be a number in (0, {MAX_CAPACITY_FACTOR:g}] (null: dropless), "
                         f"got {capacity_factor!r}")
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def slot_positions(expert_idx: Tensor, num_experts: int) -> Tensor:
    """[T, K] each choice's index among its expert's choices, choice-major (all first choices
    before any second choice), token order inside; dropped (-1) choices get positions past the end."""
    t, k = expert_idx.shape
    flat = expert_idx.t().reshape(-1)
    key = torch.where(flat >= 0, flat, num_experts)  # dropped slots sort last
    order = torch.argsort(key, stable=True)  # grouped by expert, priority order kept inside a group
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=key.device).scatter_add_(0, key,
                                                                                          torch.ones_like(key))
    start = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device) - start[key[order]]  # slot in its expert
    return position.reshape(k, t).t()


def apply_capacity(expert_idx: Tensor, gates: Tensor, num_experts: int, capacity: int) -> tuple[Tensor, Tensor, Tensor]:
    """(expert ids with dropped slots -1, gates 0 there, the number dropped as a 0-dim tensor: no host read)."""
    keep = (expert_idx >= 0) & (slot_positions(expert_idx, num_experts) < capacity)
    dropped = (expert_idx >= 0).sum() - keep.sum()
    return torch.where(keep, expert_idx, -1), torch.where(keep, gates, torch.zeros_like(gates)), dropped


def capacity_step(expert_idx: Tensor, gates: Tensor, num_experts: int, capacity_factor, stats: dict):
    """Apply ``capacity_factor`` (None: dropless) and record "dropped" (added up; a tensor once a slot
    could drop) and "capacity" in stats."""
    stats.setdefault("dropped", 0)
    if capacity_factor is None:
        return expert_idx, gates
    t, k = expert_idx.shape
    cap = capacity_for(t, k, num_experts, capacity_factor)
    expert_idx, gates, dropped = apply_capacity(expert_idx, gates, num_experts, cap)
    stats["dropped"] += dropped
    stats["capacity"] = cap
    return expert_idx, gates


def check_one_capacity(router, capacity_factor) -> None:
    """Refuse capacity set twice: a Switch router's own ``capacity_factor`` (the Switch baseline's)
    and its layer's would both drop slots, the second cutting what the first kept."""
    own = router.capacity_factor
    if capacity_factor is not None and own is not None:
        raise ValueError(f"capacity is set twice: the layer's capacity_factor={capacity_factor} (model.capacity_factor "
                         f"in a training config) and the router's capacity_factor={own}; set one of them")
