"""One exchange of token copies: split sizes (with the agreement header), then one all-to-all for
the payload rows and one for every piece of routing metadata, packed into a single int64 buffer.

An exchange executes one ``placement.plan.Exchange``: pairs (row, expert, gate) grouped into
copies by destination. Its host reads are one: the split sizes, the per-expert pair counts the
destination's experts need and the agreement header (``agree.py``) travel in one small
all-to-all and come back to the host together. Everything else runs on the device with sizes
known from that read.

Per destination, the metadata buffer holds its copies' integer tags (categories, row tags;
``Mc`` columns) and then its pairs, two int64 each: the local copy index, and the expert id
in the high 32 bits beside the gate's float32 bits. The gate is a float whose gradient must
flow back to the router, so the exchange is one autograd node
(``_Exchange``) whose backward returns the payload's and the gates' gradients through the
reverse all-to-alls. One node per exchange, always part of the graph when grad mode is on (a
dummy input that requires grad): two independent nodes could run their backward collectives
in a different order on different ranks, and a rank whose inputs need no gradient would skip
a backward collective its peers enter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dist_moe.dispatch.agree import check_headers
from dist_moe.dispatch.groups import strong, weak
from placement.plan import Exchange

_PAIR_COLUMNS = 2  # local copy index; expert id << 32 | gate bits
_LOW = 0xFFFFFFFF


def _a2a(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def _gate_bits(g: Tensor) -> Tensor:
    return g.float().contiguous().view(torch.int32).long() & _LOW


def _gate_value(packed: Tensor) -> Tensor:
    return (packed & _LOW).to(torch.int32).view(torch.float32)  # the low word, as float32 bits


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, sizes, _anchor, payload, gates, meta):
        """sizes = (send copies, recv copies, send meta elements, recv meta elements, send pairs,
        recv pairs, gate slots in the send buffer, gate slots in the received buffer)."""
        send_c, recv_c, send_m, recv_m, send_p, recv_p, gate_at, gate_from = sizes
        ctx.group, ctx.sizes = weak(group), (send_c, recv_c, send_p, recv_p)
        ctx.payload_meta = (payload.shape[1:], payload.dtype, payload.device)
        packed = meta.clone()
        packed[gate_at] = packed[gate_at] | _gate_bits(gates)  # beside the expert id's high word
        out = _a2a(payload, send_c, recv_c, group)
        recv_meta = _a2a(packed, send_m, recv_m, group)
        ctx.mark_non_differentiable(recv_meta)
        return out, _gate_value(recv_meta[gate_from]), recv_meta

    @staticmethod
    def backward(ctx, grad_out, grad_gates, _):
        group = strong(ctx.group, "an exchange's backward")
        send_c, recv_c, send_p, recv_p = ctx.sizes
        shape, dtype, device = ctx.payload_meta
        if grad_out is None:  # still take part: every rank runs the same collectives
            grad_out = torch.zeros((sum(recv_c), *shape), dtype=dtype, device=device)
        if grad_gates is None:
            grad_gates = torch.zeros(sum(recv_p), device=grad_out.device)
        grad_payload = _a2a(grad_out, recv_c, send_c, group)
        grad_g = _a2a(grad_gates.float(), recv_p, send_p, group)
        return None, None, None, grad_payload, grad_g, None


class _Return(torch.autograd.Function):
    """The combine: one reduced row per received copy goes back the way it came."""

    @staticmethod
    def forward(ctx, group, send, recv, _anchor, y):
        ctx.group, ctx.splits = weak(group), (send, recv)
        return _a2a(y, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        group = strong(ctx.group, "a combine's backward")
        return None, None, None, None, _a2a(grad.contiguous(), recv, send, group)


def _anchor(device) -> Tensor:
    return torch.zeros((), device=device, requires_grad=torch.is_grad_enabled())


def _blocks(first: list[int], first_width: int, second: list[int], second_width: int, device):
    """Flat positions of per-peer blocks [first rows x first_width | second rows x second_width]:
    (positions of the first parts' elements, of the second parts' elements), in peer order."""
    sizes = [a * first_width + b * second_width for a, b in zip(first, second)]
    start = torch.tensor([0, *sizes[:-1]], device=device).cumsum(0)
    n_a, n_b = sum(first), sum(second)
    peers = torch.arange(len(first), device=device)
    a_peer = peers.repeat_interleave(torch.tensor(first, device=device), output_size=n_a)
    b_peer = peers.repeat_interleave(torch.tensor(second, device=device), output_size=n_b)
    a_start = torch.tensor(first, device=device).cumsum(0) - torch.tensor(first, device=device)
    b_start = torch.tensor(second, device=device).cumsum(0) - torch.tensor(second, device=device)
    a_row = torch.arange(n_a, device=device) - a_start[a_peer]
    b_row = torch.arange(n_b, device=device) - b_start[b_peer]
    first_count = torch.tensor(first, device=device)
    cols_a = torch.arange(first_width, device=device)
    cols_b = torch.arange(second_width, device=device)
    pos_a = (start[a_peer] + a_row * first_width).unsqueeze(1) + cols_a
    pos_b = (start[b_peer] + first_count[b_peer] * first_width + b_row * second_width).unsqueeze(1) + cols_b
    return pos_a, pos_b


@dataclass
class Received:
    """What one exchange delivered: copies, their integer tags, and their pairs."""

    x: Tensor  # [R, H] received copies
    copy_meta: Tensor  # [R, Mc]
    pair_copy: Tensor  # [Q] index into x
    pair_expert: Tensor  # [Q] global expert id
    pair_gate: Tensor  # [Q] (differentiable)
    expert_counts: list  # pairs per local expert (the destination's experts), from the header
    _splits: tuple
    _group: object

    def send_back(self, y: Tensor) -> Tensor:
        """[R, H] one reduced row per received copy -> [N, H] rows of the copies this rank sent."""
        recv, send = self._splits
        group = strong(self._group, "an exchange's way back")
        return _Return.apply(group, recv, send, _anchor(y.device), y)


def exchange(group, stage: Exchange, rows: Tensor, pair_row: Tensor, pair_expert: Tensor, pair_gate: Tensor,
             row_meta: Tensor, expert_slot: Tensor, num_local: int, tag: int = 0,
             problem: Tensor | None = None):
    """Send the copies of ``stage`` (rows of ``rows``, their ``row_meta`` [R, Mc]) and their pairs.

    ``expert_slot`` [E] maps an expert to its slot on its rank (``num_local`` slots per rank), so
    each destination learns from the header how many pairs each of its experts gets. Returns
    (what this rank received, copies sent per peer, pairs sent per peer, the sent copies' rows).
    """
    w, device = stage.num_dst, rows.device
    order = stage.order
    exp_s = pair_expert[order]
    per_expert = torch.zeros((w + 1) * num_local, dtype=torch.long, device=device)
    per_expert.scatter_add_(0, stage.dst * num_local + expert_slot[exp_s.clamp_min(0)], torch.ones_like(exp_s))
    code = problem.reshape(1).long() if problem is not None else torch.zeros(1, dtype=torch.long, device=device)
    header = torch.cat([torch.full((1,), tag, dtype=torch.long, device=device), code]).expand(w, 2)
    counts = torch.cat([stage.copies_per_dst.unsqueeze(1), stage.pairs_per_dst.unsqueeze(1),
                        per_expert[: w * num_local].reshape(w, num_local), header], 1)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts.contiguous(), group=group)
    sent_rows, got_rows = torch.stack([counts, got]).tolist()  # the exchange's one host read
    check_headers([r[-2] for r in got_rows], [r[-1] for r in got_rows], tag)
    send_c, send_p = [r[0] for r in sent_rows], [r[1] for r in sent_rows]
    recv_c, recv_p = [r[0] for r in got_rows], [r[1] for r in got_rows]
    expert_counts = [sum(r[2 + j] for r in got_rows) for j in range(num_local)]
    n_c, n_p = sum(send_c), sum(send_p)

    copy_row = stage.copy_values(pair_row, n_c)  # the first n_c copies are the sent ones (dropped last)
    mc = row_meta.shape[1]
    pos_c, pos_p = _blocks(send_c, mc, send_p, _PAIR_COLUMNS, device)
    meta = torch.zeros(n_c * mc + n_p * _PAIR_COLUMNS, dtype=torch.long, device=device)
    meta[pos_c.reshape(-1)] = row_meta[copy_row].reshape(-1)
    pairs = torch.stack([stage.local_copy()[:n_p], exp_s[:n_p] << 32], 1)
    meta[pos_p.reshape(-1)] = pairs.reshape(-1)
    rpos_c, rpos_p = _blocks(recv_c, mc, recv_p, _PAIR_COLUMNS, device)
    sizes = (send_c, recv_c, [c * mc + p * _PAIR_COLUMNS for c, p in zip(send_c, send_p)],
             [c * mc + p * _PAIR_COLUMNS for c, p in zip(recv_c, recv_p)], send_p, recv_p, pos_p[:, 1],
             rpos_p[:, 1])
    gates = pair_gate[order][:n_p]
    x, g, got_meta = _Exchange.apply(group, sizes, _anchor(device), rows[copy_row], gates, meta)
    got_pairs = got_meta[rpos_p]  # [Q, 2]
    # pair copy ids are local to their sender's chunk: shift by that chunk's offset here
    peers = torch.arange(w, device=device)
    sender = peers.repeat_interleave(torch.tensor(recv_p, device=device), output_size=sum(recv_p))
    chunk = torch.tensor(recv_c, device=device)
    chunk_start = chunk.cumsum(0) - chunk
    received = Received(x, got_meta[rpos_c].reshape(sum(recv_c), mc), got_pairs[:, 0] + chunk_start[sender],
                        got_pairs[:, 1] >> 32, g, expert_counts, (recv_c, send_c), weak(group))
    return received, send_c, send_p, copy_row
