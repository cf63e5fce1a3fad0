"""The combine's sums: each row's contributions (gated expert outputs, copies coming back) summed in a fixed order.

``index_add``, ``scatter_add`` and ``index_put(accumulate=True)`` add with atomics on a GPU: a row that
takes three or more contributions (a token's top-k outputs, its copies coming back, the gradient of
a row gathered k times) gets them in whatever order the threads land, so a rerun differs in the
last bits. No float sum here depends on that order, nor on torch's deterministic mode: each
contribution gets a place of its own in a dense [rows, per_row, ...] buffer (a plain write, never
two to one place) and each row's places are summed in order (``sum_rows``). ``take_rows`` is the
gather whose backward is that sum. The same code runs on CPU and CUDA, forward and backward.

``gated`` and ``add_rows`` are the product and the index_add sum of the other combine: the same numbers as
``out.float() * gate`` and ``index_add``, saving for backward only what it needs in the dtype it came in
(torch's index_add keeps its whole fp32 source, and ``out.float()`` an fp32 copy of bf16 outputs).

The experts stage that sums through these is ``apply_experts.py``.
"""
from __future__ import annotations

import torch
from torch import Tensor


def row_places(index: Tensor, num_rows: int, per_row: int) -> Tensor:
    """Each contribution's place in the dense [num_rows * per_row] layout of ``sum_rows``: its row's
    block, at its rank among that row's contributions in their order here. A row may take at most
    ``per_row``: its callers' rows do by construction (a token's k pairs, its copies, one per destination),
    which the CPU checks on every call; a GPU does not, since a device assert would end every later CUDA
    call of the process."""
    order = torch.argsort(index, stable=True)
    counts = torch.zeros(num_rows, dtype=torch.long, device=index.device).scatter_add_(0, index, torch.ones_like(index))
    start = counts.cumsum(0) - counts
    rank = torch.empty_like(index)
    rank[order] = torch.arange(index.numel(), device=index.device) - start[index[order]]
    if index.device.type == "cpu":  # raises here at once: no device assert on a GPU
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


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: Tensor, gate: Tensor):
        ctx.save_for_backward(out, gate)
        return out.float() * gate.float().unsqueeze(1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out, gate = ctx.saved_tensors
        grad_out = (grad * gate.float().unsqueeze(1)).to(out.dtype)
        return grad_out, (grad * out.float()).sum(1).to(gate.dtype)


class _AddRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: Tensor, index: Tensor, num_rows: int):
        ctx.save_for_backward(index)
        out = values.new_zeros((num_rows,) + tuple(values.shape[1:]))
        return out.index_add_(0, index, values)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def gated(out: Tensor, gate: Tensor) -> Tensor:
    """fp32 ``out * gate[:, None]`` (an expert's outputs [pairs, H] by their gates [pairs]), keeping ``out`` for
    backward in its own dtype (bf16 under autocast) rather than an fp32 copy."""
    return _Gated.apply(out, gate)


def add_rows(values: Tensor, index: Tensor, num_rows: int) -> Tensor:
    """``zeros(num_rows, ...).index_add(0, index, values)`` (atomics on a GPU), keeping only ``index`` for backward."""
    return _AddRows.apply(values, index, num_rows)
