"""One exchange of token copies, cut by token into chunks whose payloads can be in flight while
experts run (``pipeline.py``).

An exchange executes one ``placement.plan.Exchange`` per chunk: pairs (row, expert, gate)
grouped into copies by destination. Its plan phase moves only metadata. One small all-to-all
carries every chunk's split sizes, the per-expert pair counts the destination's experts need and
the agreement header (``agree.py``), and comes back to the host once: the exchange's one host
read, whatever the number of chunks. Then one more all-to-all carries every chunk's routing
metadata (``start_merged``: per destination, chunk after chunk; the payload leaves without
waiting for it, and the destination waits where it first reads a received pair: ``Metadata``),
each chunk's packed into int64: per destination its copies' integer tags (categories, row
tags; ``Mc`` columns) and then its pairs, two int64 each, the local copy index, and the expert
id in the high 32 bits beside the gate's float32 bits. The backward returns a hop's gate
gradients the same way, every chunk's in one all-to-all (``pairs_back``). So an exchange costs
2 + 2C all-to-alls forward and 2C + 1 backward for C chunks, whatever the dedup mode's hops
repeat.

Host integers serve only the collective API's split sizes. Everything the exchange indexes with
(offsets, block positions, peer ids, the received pairs' copies) is derived on the payload's
device from the exchanged counts, kept there as well (``Sizes.on_device``), with ``cumsum`` and
``repeat_interleave(..., output_size=<host int>)``: no tensor is built from Python data, which on
a GPU would be a blocking host-to-device copy (``tests/train/test_sync_budget.py`` counts both kinds).

After the plan phase each chunk is a ``Hop``: its payload rows go out and come back with async
all-to-alls whose sizes are known, so nothing more is read back to the host. Gradients are not
tracked through a hop; the pipeline runs them backwards itself, through the same hops.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dist_moe.dispatch.agree import check_headers
from dist_moe.distributed.groups import strong, weak
from placement.plan import Exchange

_PAIR_COLUMNS = 2  # local copy index; expert id << 32 | gate bits
_LOW = 0xFFFFFFFF


class WaitClock:
    """The time spent waiting in exchanges. On the CPU a wait blocks the host: timed with perf_counter.
    On CUDA a wait only orders the current stream after the collective, and the host's time around
    the split sizes' read includes every kernel queued before it; so there each wait is timed on the
    current stream, by a pair of CUDA events, which are read only when the total is asked for: no
    synchronisation per exchange."""

    FOLD_AT = 4096  # pending pairs: past this, those already run are read (a query, never a wait)

    def __init__(self):
        self.seconds = 0.0
        self.pending: list = []  # (start, end) CUDA events, not read yet

    @contextlib.contextmanager
    def timing(self, device: torch.device):
        if device.type != "cuda":
            start = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - start
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self.pending.append((begin, end))
        if len(self.pending) >= self.FOLD_AT:  # a run that never asks for the total stays bounded
            self._read(wait=False)

    def _read(self, wait: bool) -> None:
        while self.pending:
            start, end = self.pending[0]
            if wait:
                end.synchronize()  # waits for this event alone, not the device
            elif not end.query():
                return
            self.seconds += start.elapsed_time(end) / 1e3
            self.pending.pop(0)

    def total(self, settled: bool = True) -> float:
        """Seconds waited so far; ``settled=False`` reads only the events already run (no wait)."""
        self._read(wait=settled)
        return self.seconds


WAITS = WaitClock()


def blocked_seconds(settled: bool = True) -> float:
    """Seconds this process has spent waiting in dist-moe's exchanges so far: every wait for an
    all-to-all and the split sizes' exchange. The trainer logs its growth per step
    (``exchange_wait_s``). On gloo that is the host's time blocked; on CUDA the current stream's
    (``WaitClock``), read here: ``settled`` waits for the last exchange's timing events to run (a
    synchronisation), else the waits not yet run on the device count later."""
    return WAITS.total(settled)


class Pending:
    """An all-to-all in flight; ``wait()`` returns its output (on CUDA: orders the current stream
    after it, without blocking the host). The input is kept alive until then."""

    def __init__(self, out: Tensor, work, source: Tensor):
        self.out, self._work = out, work
        self._source: Tensor | None = source

    def wait(self) -> Tensor:
        if self._work is not None:
            with WAITS.timing(self.out.device):
                self._work.wait()
            self._work = self._source = None  # no work object outlives its wait (groups.py)
        return self.out


def start_a2a(x: Tensor, send: list[int], recv: list[int], group) -> Pending:
    x = x.contiguous()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x, recv, send, group=group, async_op=True)
    return Pending(out, work, x)


def _gate_bits(g: Tensor) -> Tensor:
    return g.float().contiguous().view(torch.int32).long() & _LOW


def _gate_value(packed: Tensor) -> Tensor:
    return (packed & _LOW).to(torch.int32).view(torch.float32)  # the low word, as float32 bits


HOST_READS = [0]  # reads made by read_to_host in this process


def read_to_host(t: Tensor) -> list:
    """``t.tolist()``: an exchange's one host read (its split sizes). Every other value the dispatcher
    indexes with stays on the payload's device. Under ``torch.cuda.set_sync_debug_mode("error")``
    (``benchmarks/gpu_check.py``) this is the one synchronisation allowed: the mode is lowered for
    this read alone, and ``HOST_READS`` counts it, so a check can tell it from any other."""
    HOST_READS[0] += 1
    mode = torch.cuda.get_sync_debug_mode() if t.is_cuda else 0
    if not mode:
        return t.tolist()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return t.tolist()
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def _spread(counts: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """Items laid out peer by peer, ``counts[i]`` of peer i (``total`` = their sum, a host int):
    (peer of each item, its index inside its peer's block), built on ``counts``' device."""
    peers = torch.arange(counts.shape[0], device=counts.device)
    peer = peers.repeat_interleave(counts, output_size=total)
    return peer, torch.arange(total, device=counts.device) - (counts.cumsum(0) - counts)[peer]


def _blocks(first: Tensor, first_width: int, second: Tensor, second_width: int, n_first: int, n_second: int):
    """Flat positions of per-peer blocks [first rows x first_width | second rows x second_width]:
    (positions of the first parts' elements, of the second parts' elements), in peer order.
    ``first`` / ``second`` are the per-peer row counts on the device; ``n_*`` their host sums."""
    sizes = first * first_width + second * second_width
    start = sizes.cumsum(0) - sizes
    a_peer, a_row = _spread(first, n_first)
    b_peer, b_row = _spread(second, n_second)
    cols_a = torch.arange(first_width, device=first.device)
    cols_b = torch.arange(second_width, device=first.device)
    pos_a = (start[a_peer] + a_row * first_width).unsqueeze(1) + cols_a
    pos_b = (start[b_peer] + first[b_peer] * first_width + b_row * second_width).unsqueeze(1) + cols_b
    return pos_a, pos_b


@dataclass
class Sizes:
    """One chunk's split sizes per peer: host lists for the collective API (``send_c`` ...), and the
    same counts as device tensors ``[4, W]`` (copies sent, received, pairs sent, received) that
    every index is derived from."""

    send_c: list
    recv_c: list
    send_p: list
    recv_p: list
    on_device: Tensor


@dataclass
class Chunk:
    """One chunk's pairs before an exchange: ``hop`` groups them; ``pair_row`` indexes ``row_meta``
    (and the payload rows the pipeline sends); a sent pair's index is ``first_pair`` + its index here."""

    hop: Exchange
    pair_row: Tensor
    pair_expert: Tensor
    pair_gate: Tensor
    row_meta: Tensor  # [rows, Mc] integer tags of every row
    first_pair: int = 0


class Hop:
    """One chunk of one exchange after its plan phase: what this rank sends and what it received.
    Split sizes and what the sender indexes with are known at once; the received pairs and tags
    (``pair_copy``, ``pair_expert``, ``pair_gate``, ``copy_meta``) arrive with the exchange's
    metadata, waited for at their first use: the payload can leave before it has arrived."""

    def __init__(self, sizes: Sizes, copy_row: Tensor, sent_pairs: Tensor, expert_counts: list, group,
                 metadata: Metadata, index: int):
        self.send_c, self.recv_c = sizes.send_c, sizes.recv_c  # copies to / from each peer
        self.send_p, self.recv_p = sizes.send_p, sizes.recv_p  # pairs to / from each peer
        self.copy_row = copy_row  # [n_c] the sender's row of each sent copy, in peer order
        self.sent_pairs = sent_pairs  # [n_p] the sender's index of each sent pair, in the order they travel
        self.expert_counts = expert_counts  # received pairs per local expert
        self.counts = sizes.on_device  # [4, W]: copies sent, received, pairs sent, received
        self._group = weak(group)
        self._metadata, self._index = metadata, index

    @property
    def pair_copy(self) -> Tensor:
        """[Q] the received copy of each received pair."""
        return self._metadata.chunk(self._index)[0]

    @property
    def pair_expert(self) -> Tensor:
        """[Q] global expert id of each received pair."""
        return self._metadata.chunk(self._index)[1]

    @property
    def pair_gate(self) -> Tensor:
        """[Q] float32 gate of each received pair."""
        return self._metadata.chunk(self._index)[2]

    @property
    def copy_meta(self) -> Tensor:
        """[R, Mc] the received copies' integer tags."""
        return self._metadata.chunk(self._index)[3]

    def out(self, rows: Tensor) -> Pending:
        """[n_c, ...] rows aligned with the sent copies -> [R, ...] at the receivers."""
        return start_a2a(rows, self.send_c, self.recv_c, strong(self._group, "an exchange"))

    def back(self, rows: Tensor) -> Pending:
        """[R, ...] rows aligned with the received copies -> [n_c, ...] at their senders."""
        return start_a2a(rows, self.recv_c, self.send_c, strong(self._group, "an exchange's way back"))


class Metadata:
    """Every chunk's received routing metadata of one exchange, from one all-to-all in flight, unpacked
    for all chunks at the first use of any."""

    def __init__(self, pending: Merged, parts: list):
        self._pending: Merged | None = pending
        self._parts = parts
        self._got: list | None = None  # parts: per chunk (sizes, Mc)

    def chunk(self, i: int) -> tuple:
        if self._got is None:
            assert self._pending is not None  # waited once, with _got set
            got = self._pending.wait()
            self._got = [_unpacked(g, sizes, mc) for g, (sizes, mc) in zip(got, self._parts)]
            self._pending = None
        return self._got[i]


def _counts(chunk: Chunk, expert_slot: Tensor, num_local: int) -> Tensor:
    """[W, 2 + num_local]: copies, pairs and pairs per destination expert slot, per destination."""
    hop = chunk.hop
    w = hop.num_dst
    exp_s = chunk.pair_expert[hop.order]
    per_expert = torch.zeros((w + 1) * num_local, dtype=torch.long, device=exp_s.device)
    per_expert.scatter_add_(0, hop.dst * num_local + expert_slot[exp_s.clamp_min(0)], torch.ones_like(exp_s))
    return torch.cat([hop.copies_per_dst.unsqueeze(1), hop.pairs_per_dst.unsqueeze(1),
                      per_expert[: w * num_local].reshape(w, num_local)], 1)


def plan_hops(group, chunks: list[Chunk], expert_slot: Tensor, num_local: int, tag: int = 0,
              problem: Tensor | None = None, wire: int = 0) -> list[Hop]:
    """The plan phase of one exchange over ``group`` for every chunk: one host read in all.

    ``expert_slot`` [E] maps an expert to its slot on its rank (``num_local`` slots per rank), so
    each destination learns from the header how many pairs each of its experts gets. ``wire``: the code of
    what this rank's rows travel in (``wire.Wire.code``), which every rank must send alike.
    """
    w, device = chunks[0].hop.num_dst, chunks[0].pair_row.device
    code = problem.reshape(1).long() if problem is not None else torch.zeros(1, dtype=torch.long, device=device)
    header = torch.cat([torch.full((1,), tag, dtype=torch.long, device=device), code,
                        torch.full((1,), wire, dtype=torch.long, device=device)]).expand(w, 3)
    counts = torch.cat([_counts(c, expert_slot, num_local) for c in chunks] + [header], 1).contiguous()
    got = torch.empty_like(counts)
    with WAITS.timing(device):
        dist.all_to_all_single(got, counts, group=group)
        both = torch.stack([counts, got])  # [2, W, chunks * width + 2]
        sent_rows, got_rows = read_to_host(both)  # the exchange's one host read
    check_headers([r[-3] for r in got_rows], [r[-2] for r in got_rows], tag, wires=[r[-1] for r in got_rows])
    width = 2 + num_local
    buffers: list = []
    kept: list = []
    expert_counts: list = []
    meta_counts: list = []
    for i, chunk in enumerate(chunks):
        at = i * width
        sizes = Sizes([r[at] for r in sent_rows], [r[at] for r in got_rows], [r[at + 1] for r in sent_rows],
                      [r[at + 1] for r in got_rows], both[:, :, at:at + 2].permute(2, 0, 1).reshape(4, w))
        expert_counts.append([sum(r[at + 2 + j] for r in got_rows) for j in range(num_local)])
        meta, rest = _metadata(chunk, sizes)
        buffers.append(meta)
        kept.append(rest)
        meta_counts.append(_meta_counts(sizes, chunk.row_meta.shape[1]))
    send, send_lists, recv, recv_lists = zip(*meta_counts)
    # every chunk's metadata in one all-to-all, waited for where it is first used (the payload needs none)
    metadata = Metadata(start_merged(buffers, torch.stack(send), list(send_lists), torch.stack(recv),
                                     list(recv_lists), group), [(rest[0], rest[3]) for rest in kept])
    return [Hop(sizes, copy_row, sent_pairs, n, group, metadata, i)
            for i, ((sizes, copy_row, sent_pairs, _), n) in enumerate(zip(kept, expert_counts))]


def _metadata(chunk: Chunk, sizes: Sizes):
    """One chunk's metadata buffer, peer-major (per destination: copies' tags, then pairs), and what
    ``_received`` needs besides the received buffer."""
    hop = chunk.hop
    n_c, n_p, mc = sum(sizes.send_c), sum(sizes.send_p), chunk.row_meta.shape[1]
    order = hop.order[:n_p]  # sent pairs come first; dropped ones sort last and stay
    copy_row = hop.copy_values(chunk.pair_row, n_c)
    send_c, _, send_p, _ = sizes.on_device
    pos_c, pos_p = _blocks(send_c, mc, send_p, _PAIR_COLUMNS, n_c, n_p)
    meta = torch.zeros(n_c * mc + n_p * _PAIR_COLUMNS, dtype=torch.long, device=chunk.pair_row.device)
    meta[pos_c.reshape(-1)] = chunk.row_meta[copy_row].reshape(-1)
    packed = (chunk.pair_expert[order] << 32) | _gate_bits(chunk.pair_gate[order].detach())
    meta[pos_p.reshape(-1)] = torch.stack([hop.local_copy()[:n_p], packed], 1).reshape(-1)
    return meta, (sizes, copy_row, order + chunk.first_pair, mc)


def _meta_counts(sizes: Sizes, mc: int) -> tuple[Tensor, list, Tensor, list]:
    """Metadata elements per peer, sent and received: (device counts, host list) each."""
    send_c, recv_c, send_p, recv_p = sizes.on_device
    host = [[c * mc + p * _PAIR_COLUMNS for c, p in zip(cs, ps)]
            for cs, ps in ((sizes.send_c, sizes.send_p), (sizes.recv_c, sizes.recv_p))]
    return send_c * mc + send_p * _PAIR_COLUMNS, host[0], recv_c * mc + recv_p * _PAIR_COLUMNS, host[1]


class Merged:
    """Several chunks' peer-major buffers in one all-to-all (``start_merged``); ``wait()`` returns
    each chunk's received buffer, peer-major again."""

    def __init__(self, pending: Pending, positions: list[Tensor]):
        self._pending, self._positions = pending, positions

    def wait(self) -> list[Tensor]:
        got = self._pending.wait()
        return [got[pos] for pos in self._positions]


def _merged_positions(counts: Tensor, totals: list) -> list[Tensor]:
    """[C, W] elements of chunk i for peer p (device), ``totals`` each chunk's host sum -> for each
    chunk, the position of each of its (peer-major) elements in the merged buffer, where every
    peer's block holds the chunks' blocks for it in chunk order."""
    per_peer = counts.sum(0)
    start = (per_peer.cumsum(0) - per_peer).unsqueeze(0) + (counts.cumsum(0) - counts)  # [C, W]
    out = []
    for i, total in enumerate(totals):
        peer, index = _spread(counts[i], total)
        out.append(start[i][peer] + index)
    return out


def start_merged(buffers: list[Tensor], send: Tensor, send_lists: list, recv: Tensor, recv_lists: list,
                 group) -> Merged:
    """One all-to-all for several chunks' peer-major buffers (``send`` / ``recv`` [C, W]: each chunk's
    elements per peer on the device, ``*_lists`` the same as host lists): fewer collectives, each
    chunk's layout unchanged at both ends."""
    device = buffers[0].device
    merged = buffers[0].new_empty((sum(sum(s) for s in send_lists),) + tuple(buffers[0].shape[1:]))
    for buf, pos in zip(buffers, _merged_positions(send.to(device), [sum(s) for s in send_lists])):
        merged[pos] = buf
    pending = start_a2a(merged, [sum(c) for c in zip(*send_lists)], [sum(c) for c in zip(*recv_lists)], group)
    return Merged(pending, _merged_positions(recv.to(device), [sum(r) for r in recv_lists]))


def pairs_back(hops: list[Hop], values: list[Tensor]) -> Merged:
    """Every chunk's per-received-pair values ([Q] each) back to their senders in one all-to-all;
    ``wait()`` gives each chunk's [n_p] in its ``sent_pairs`` order (the gate gradients of a hop)."""
    group = strong(hops[0]._group, "an exchange's way back")
    return start_merged(values, torch.stack([hop.counts[3] for hop in hops]), [hop.recv_p for hop in hops],
                        torch.stack([hop.counts[2] for hop in hops]), [hop.send_p for hop in hops], group)


def _unpacked(got_meta: Tensor, sizes: Sizes, mc: int) -> tuple:
    """One chunk's received metadata buffer -> (pair_copy, pair_expert, pair_gate, copy_meta)."""
    n_c, n_p = sum(sizes.recv_c), sum(sizes.recv_p)
    _, recv_c, _, recv_p = sizes.on_device
    rpos_c, rpos_p = _blocks(recv_c, mc, recv_p, _PAIR_COLUMNS, n_c, n_p)
    got_pairs = got_meta[rpos_p]  # [Q, 2]
    # pair copy ids are local to their sender's block: shift by that block's offset here
    sender, _ = _spread(recv_p, n_p)
    block_start = recv_c.cumsum(0) - recv_c
    return (got_pairs[:, 0] + block_start[sender], got_pairs[:, 1] >> 32, _gate_value(got_pairs[:, 1]),
            got_meta[rpos_c].reshape(n_c, mc))
