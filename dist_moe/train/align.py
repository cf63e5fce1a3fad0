"""SpecDrop's Align (SpecDrop, section 5.6): does each category depend most on its branch?

For every expert e, zero-ablate e in every MoE layer and measure each category's
loss; the expert whose removal raises a category's loss the most is the one it
relies on (ties go to the lowest index). Align is the share of categories whose
most-relied-on expert is their assigned one. Under data or expert parallelism
each rank evaluates its own data and the per-category loss sums and counts are
summed over ``group`` before anything is compared, so every rank gets the same
answer.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor, nn

from dist_moe.distributed.reductions import all_reduce_sum
from dist_moe.moe.layer import MoELayer
from dist_moe.moe.view import moe_layers


@contextlib.contextmanager
def ablate(model: nn.Module, experts):
    """Zero the gated output of ``experts`` (global ids) in every MoELayer of ``model``."""
    layers = [m for m in moe_layers(model) if isinstance(m, MoELayer)]  # dist-moe's own layers ablate
    previous = [layer.ablated_experts for layer in layers]
    for layer in layers:
        layer.ablated_experts = frozenset(int(e) for e in experts)
    try:
        yield
    finally:
        for layer, before in zip(layers, previous):
            layer.ablated_experts = before


@torch.no_grad()
def specdrop_align(model: nn.Module, evaluate: Callable[[nn.Module], tuple[Tensor, Tensor]],
                   assigned_expert: Tensor, num_experts: int, group=None) -> dict:
    """``evaluate(model)`` -> (loss sum [C], example count [C]) on this rank's data.

    Returns {"align": share of evaluated categories relying most on their assigned
    expert, "most_hurt": [C] expert ids (-1 where a category has no data),
    "delta": [E, C] loss increase per ablated expert}.
    """

    def losses() -> tuple[Tensor, Tensor]:
        total, count = evaluate(model)
        total = all_reduce_sum(total.double(), group)
        count = all_reduce_sum(count.double(), group)
        return total / count.clamp_min(1), count

    base, count = losses()
    delta = torch.empty(num_experts, base.numel(), dtype=torch.float64, device=base.device)
    for e in range(num_experts):
        with ablate(model, [e]):
            delta[e] = losses()[0] - base
    has_data = count > 0
    most_hurt = torch.where(has_data, delta.argmax(0), -1)  # argmax: first maximum, the lowest index
    hits = (most_hurt == assigned_expert.to(most_hurt.device)) & has_data
    align = float(hits.sum() / has_data.sum()) if bool(has_data.any()) else float("nan")
    return {"align": align, "most_hurt": most_hurt, "delta": delta}
