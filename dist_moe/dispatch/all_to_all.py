"""Differentiable all-to-all with uneven splits, and a token-copy exchange built on it.

One ``_AllToAll`` node carries every tensor of an exchange (payload rows, gates,
integer metadata), and its backward sends the float tensors' gradients back in
the same fixed order. Keeping one autograd node per exchange matters: two
independent nodes could run their backward collectives in a different order on
different ranks and deadlock. For the same reason every exchange is always part
of the autograd graph when grad mode is on (a dummy input that requires grad):
otherwise a rank whose inputs need no gradient (a frozen router, an input without
grad, no tokens received) would skip a backward collective its peers enter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dist_moe.dispatch.agree import check_headers
from dist_moe.dispatch.groups import strong, weak


def _a2a(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, splits, _anchor, *tensors):
        """splits[i] = (send, recv) for tensors[i]; returns the received tensors."""
        ctx.group, ctx.splits = weak(group), splits  # weakly: see dispatch/groups.py
        ctx.float_mask = [t.is_floating_point() for t in tensors]
        outs = [_a2a(t, s, r, group) for t, (s, r) in zip(tensors, splits)]
        ctx.mark_non_differentiable(*[o for o, f in zip(outs, ctx.float_mask) if not f])
        ctx.meta = [(tuple(t.shape), t.dtype, t.device) for t in tensors]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        out = []
        for g, (send, recv), is_float, (shape, dtype, device) in zip(grads, ctx.splits, ctx.float_mask, ctx.meta):
            if not is_float:
                out.append(None)
                continue
            if g is None:  # still take part: every rank runs the same collectives
                g = torch.zeros((sum(recv),) + shape[1:], dtype=dtype, device=device)
            out.append(_a2a(g, recv, send, strong(ctx.group, "an all-to-all's backward")))
        return (None, None, None, *out)


def all_to_all(group, splits, *tensors) -> tuple[Tensor, ...]:
    anchor = torch.zeros((), requires_grad=torch.is_grad_enabled())
    return _AllToAll.apply(group, splits, anchor, *tensors)


def exchange_counts(counts: Tensor, group) -> Tensor:
    """counts [W, C] (what I send to each rank) -> [W, C] (what each rank sends me)."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


@dataclass
class Received:
    """Copies received in one exchange, their (expert, gate) pairs, and the way back."""

    x: Tensor  # [R, H] received copies
    pair_copy: Tensor  # [P] index into x
    pair_expert: Tensor  # [P] global expert id
    pair_gate: Tensor  # [P]
    copy_meta: Tensor  # [R, M] per-copy integer metadata (e.g. categories), possibly M = 0
    _inverse: Tensor  # position of each original copy in the sorted send buffer
    _splits: tuple
    _group: object

    def send_back(self, y: Tensor) -> Tensor:
        """[R, H] results (one reduced row per received copy) -> [N, H] in the sender's copy order."""
        send, recv = self._splits
        (back,) = all_to_all(strong(self._group, "an exchange's way back"), [(send, recv)], y)
        return back.index_select(0, self._inverse)


def send_copies(group, world: int, x: Tensor, dst: Tensor, pair_copy: Tensor, pair_expert: Tensor,
                pair_gate: Tensor, copy_meta: Tensor | None = None, tag: int = 0,
                problem: Tensor | None = None) -> tuple[Received, list[int], list[int]]:
    """Send row i of ``x`` to rank ``dst[i]`` with the pairs that point at it.

    The split sizes travel with a header, this rank's forward ``tag`` and input ``problem``
    code (``dispatch/agree.py``): any problem, or a peer at another tag, raises on every rank
    before a token moves. Returns what this rank received, and how many copies and pairs it
    sent to each rank.
    """
    n = x.shape[0]
    order = torch.argsort(dst, stable=True)
    send_counts = torch.bincount(dst, minlength=world)
    start = torch.cumsum(send_counts, 0) - send_counts
    position = torch.empty_like(order)
    position[order] = torch.arange(n, device=dst.device)
    local_id = position - start[dst]  # index of each copy inside its destination's chunk
    pair_dst = dst[pair_copy]
    porder = torch.argsort(pair_dst, stable=True)
    pair_counts = torch.bincount(pair_dst, minlength=world)

    code = problem.reshape(1).long() if problem is not None else send_counts.new_zeros(1)
    header = torch.cat([send_counts.new_full((1,), tag), code]).expand(world, 2)
    recv_counts = exchange_counts(torch.cat([torch.stack([send_counts, pair_counts], 1), header], 1), group)
    rows = recv_counts.tolist()
    check_headers([r[2] for r in rows], [r[3] for r in rows], tag)
    recv_counts = recv_counts[:, :2]
    send_c, recv_c = send_counts.tolist(), recv_counts[:, 0].tolist()
    send_p, recv_p = pair_counts.tolist(), recv_counts[:, 1].tolist()
    meta = copy_meta if copy_meta is not None else x.new_zeros((n, 0), dtype=torch.long)
    rx, rmeta, rcopy, rexp, rgate = all_to_all(
        group,
        [(send_c, recv_c), (send_c, recv_c), (send_p, recv_p), (send_p, recv_p), (send_p, recv_p)],
        x[order], meta[order], local_id[pair_copy][porder], pair_expert[porder], pair_gate[porder],
    )
    # pair copy ids are local to their sender's chunk: shift by the chunk's offset here
    chunk_start = torch.cumsum(recv_counts[:, 0], 0) - recv_counts[:, 0]
    sender = torch.repeat_interleave(torch.arange(world, device=dst.device), recv_counts[:, 1])
    received = Received(rx, rcopy + chunk_start[sender], rexp, rgate, rmeta, position, (recv_c, send_c), weak(group))
    return received, send_c, send_p
