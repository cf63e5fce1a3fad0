"""Experts applied to (row, expert, gate) pairs and their gated outputs summed per row, in a fixed order.

``index_add``, ``scatter_add`` and ``index_put(accumulate=True)`` add with atomics on a GPU: a row that
takes three or more contributions (a token's top-k outputs, its copies coming back, the gradient of
a row gathered k times) gets them in whatever order the threads land, so a rerun differs in the
last bits. No float sum here depends on that order, nor on torch's deterministic mode: each
contribution gets a place of its own in a dense [rows, per_row, ...] buffer (a plain write, never
two to one place) and each row's places are summed in order (``sum_rows``). ``take_rows`` is the
gather whose backward is that sum. The same code runs on CPU and CUDA, forward and backward.

The experts stage's drivers live here too: ``apply_experts`` (the index_add sum) and
``apply_experts_in_order`` (the fixed-order one) run each local expert once on its slice of the
pairs; ``compute_dtype`` is the dtype the experts compute in.
"""
from __future__ import annotations

import torch
from torch import Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype experts compute in: autocast's (bf16 under train.precision bf16), else ``x``'s.
    ``F.grouped_mm`` is not on autocast's lists, so the experts cast their rows themselves."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def row_places(index: Tensor, num_rows: int, per_row: int) -> Tensor:
    """Each contribution's place in the dense [num_rows * per_row] layout of ``sum_rows``: its row's
    block, at its rank among that row's contributions in their order here. A row may take at most
    ``per_row`` (checked on the device: no host read)."""
    order = torch.argsort(index, stable=True)
    counts = torch.zeros(num_rows, dtype=torch.long, device=index.device).scatter_add_(0, index, torch.ones_like(index))
    start = counts.cumsum(0) - counts
    rank = torch.empty_like(index)
    rank[order] = torch.arange(index.numel(), device=index.device) - start[index[order]]
    torch._assert_async((rank < per_row).all(), "a row takes more contributions than per_row")
    return index * per_row + rank


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: Tensor, places: Tensor, num_rows: int, per_row: int):
        ctx.save_for_backward(places)
        ctx.per_row = per_row
        shape = (num_rows * per_row,) + tuple(values.shape[1:])
        # as many values as places: every place is written, so nothing needs zeroing first
        dense = values.new_empty(shape) if values.shape[0] == shape[0] else values.new_zeros(shape)
        dense.index_put_((places,), values)  # one write per place: nothing accumulates
        return dense.view((num_rows, per_row) + tuple(values.shape[1:])).sum(1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (places,) = ctx.saved_tensors
        return take_rows(grad, places // ctx.per_row, places, ctx.per_row), None, None, None


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, places: Tensor, per_row: int):
        ctx.save_for_backward(places)
        ctx.rows, ctx.per_row = x.shape[0], per_row
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (places,) = ctx.saved_tensors
        return sum_rows(grad, places, ctx.rows, ctx.per_row), None, None, None


def sum_rows(values: Tensor, places: Tensor, num_rows: int, per_row: int) -> Tensor:
    """[num_rows, ...]: row r the sum of the ``values`` whose place lies in its block (``row_places``),
    in place order. ``places`` must be distinct. Its backward gives each value its row's gradient."""
    return _SumRows.apply(values, places, num_rows, per_row)


def take_rows(x: Tensor, index: Tensor, places: Tensor, per_row: int) -> Tensor:
    """``x[index]``, whose backward sums each row's gradients with ``sum_rows`` (``places``: each taken
    row's place, ``row_places(index, ...)`` or one the caller knows) where autograd's would
    accumulate them with atomics. A permutation or any distinct ``index`` is ``places=index, per_row=1``."""
    return _TakeRows.apply(x, index, places, per_row)


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
    return sum_rows(out.float() * gates.float().unsqueeze(1), places, x.shape[0], per_row)


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
    y = torch.zeros(x.shape[0], out.shape[1], dtype=torch.float32, device=x.device)
    return y.index_add(0, rows, out.float() * gates.float().unsqueeze(1))


def slot_counts(experts, x: Tensor, pair_slot: Tensor, counts: list[int] | None = None) -> list[int] | Tensor:
    """Pairs per local expert slot, as ``experts`` take them: grouped experts a tensor counted on the
    device (bincount would read its max back on CUDA), a loop a list (``counts`` when the caller knows
    them, else the one host read that sizing its slices takes)."""
    if experts.grouped(x):
        return torch.zeros(experts.num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, pair_slot, torch.ones_like(pair_slot))
    return counts if counts is not None else torch.bincount(pair_slot, minlength=experts.num_experts).tolist()
