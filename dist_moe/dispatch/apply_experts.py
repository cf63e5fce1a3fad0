"""The experts stage: each local expert run once on its slice of the (row, expert, gate) pairs that reached
this rank, its gated outputs summed per row: ``apply_experts`` with ``index_add``, ``apply_experts_in_order``
in a fixed order (``combine.py``'s sums); ``compute_dtype`` is the dtype the experts compute in."""
from __future__ import annotations

import torch
from torch import Tensor

from dist_moe.dispatch.combine import add_rows, gated, row_places, sum_rows, take_rows


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype experts compute in: autocast's (bf16 under train.precision bf16), else ``x``'s.
    ``F.grouped_mm`` is not on autocast's lists, so the experts cast their rows themselves."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def apply_experts_in_order(experts, x: Tensor, pairs: tuple[Tensor, Tensor, Tensor], per_row: int,
                           row_tags: Tensor | None = None, counts: list[int] | None = None,
                           places: Tensor | None = None, **weights) -> Tensor:
    """y[r] = sum over pairs p with pair_row[p] == r of gate_p * expert_{slot_p}(x[r]), in fp32.

    Pairs are grouped by local expert slot with one stable sort, so each expert runs once on a
    contiguous slice. Each row takes at most ``per_row`` pairs (a token's top-k); its gated outputs
    are summed in a fixed order (``sum_rows``): in ``places`` order when given (each pair's place,
    e.g. ``t * k + j`` for slot j of token t), else in pair order. fp32 whatever the activations'
    dtype (the caller casts once). Grouped experts get their counts from the pairs on the device;
    a loop gets ``counts`` (pairs per slot, known to the dispatcher from its exchange header), which
    saves the one host read sizing its slices takes. ``row_tags`` [rows of x] are handed to a
    tagging capture (GAR observations); ``weights=``, when given, to the experts (``Experts.forward``).
    ``pairs``: (pair_row, pair_slot, pair_gate), one entry per pair.
    """
    pair_row, pair_slot, pair_gate = pairs
    order = torch.argsort(pair_slot, stable=True)
    rows = pair_row[order]
    places = (row_places(pair_row, x.shape[0], per_row) if places is None else places)[order]
    sized = slot_counts(experts, x, pair_slot, counts)
    out = experts(take_rows(x, rows, places, per_row), sized, None if row_tags is None else row_tags[rows],
                  **weights)
    gates = take_rows(pair_gate, order, order, 1)  # a permutation: one gradient per gate
    return sum_rows(gated(out, gates), places, x.shape[0], per_row)


def apply_experts(experts, x: Tensor, pair_row: Tensor, pair_slot: Tensor, pair_gate: Tensor,
                  row_tags: Tensor | None = None, counts: list[int] | None = None, **weights) -> Tensor:
    """y[r] = sum over pairs p with pair_row[p] == r of gate_p * expert_{slot_p}(x[r]), in fp32.

    Pairs are grouped by local expert slot with one stable sort, so each expert runs
    once on a contiguous slice; gated outputs are reduced per row with index_add, in
    fp32 whatever the activations' dtype (the caller casts once). Grouped experts get their
    counts from the pairs on the device; a loop gets ``counts`` (pairs per slot, known to the
    dispatcher from its exchange header), which saves the one host read sizing its slices takes.
    ``row_tags`` [rows of x] are handed to a tagging capture (GAR observations); ``weights=``, when
    given, to the experts (``Experts.forward``).
    """
    order = torch.argsort(pair_slot, stable=True)
    rows, gates = pair_row[order], pair_gate[order]
    sized = slot_counts(experts, x, pair_slot, counts)
    out = experts(x[rows], sized, None if row_tags is None else row_tags[rows], **weights)
    return add_rows(gated(out, gates), rows, x.shape[0])


def slot_counts(experts, x: Tensor, pair_slot: Tensor, counts: list[int] | None = None) -> list[int] | Tensor:
    """Pairs per local expert slot, as ``experts`` take them: grouped experts a tensor counted on the
    device (bincount would read its max back on CUDA), a loop a list (``counts`` when the caller knows
    them, else that tensor read once: the one host read sizing its slices takes)."""
    if counts is not None and not experts.grouped(x):
        return counts
    on_device = torch.zeros(experts.num_experts, dtype=torch.long, device=x.device).scatter_add_(
        0, pair_slot, torch.ones_like(pair_slot))
    return on_device if experts.grouped(x) else on_device.tolist()
