"""The payload phase of a dispatch, chunk by chunk, with the link busy while experts compute.

Every chunk's first-hop payload is sent at once (async all-to-alls); the shared expert runs
while they are in flight; then for each chunk in turn: wait for its copies, (node dedup: forward
them inside the node, where the next chunks' first hop is still crossing the slow link), run
the experts, and start its combine without waiting for it (node dedup: the results of a chunk
come back from inside the node while the gateway computes the next chunk). Backward runs the same way in
reverse: every chunk's output gradients leave at once, the shared expert's backward runs under
them, and each chunk's expert backward overlaps the later chunks' transfers; the gate gradients
(4 bytes a pair) go back once per hop for all chunks (``all_to_all.pairs_back``).

The whole dispatch is one autograd node (``_Pipelined``). Inside it, each chunk's experts run
under ``enable_grad`` on leaves cut at the exchange, and its backward calls ``autograd.grad`` on
that small graph, so the exchanges' gradients travel on the same hops, in an order this module
fixes rather than the autograd engine (two nodes could run their backward collectives in a
different order on different ranks). The node is always in the graph when grad mode is on (an
anchor that requires grad): a rank whose inputs need no gradient still enters every backward
collective its peers do. Every rank runs every chunk, empty or not, so all ranks issue the same
collectives in the same order. Rows travel in the wire's dtype (``wire.py``; the compute dtype by default:
bf16 under autocast's bf16), in both directions, forward and backward (an fp8 wire's dispatch: packed e4m3
rows, dequantized on arrival), and are kept for backward in it; every sum
(a copy's pairs, a token's copies, their gradients) accumulates in fp32 and is cast once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from dist_moe.config.choices import MAX_PIPELINE_CHUNKS
from dist_moe.dispatch.all_to_all import Hop, Pending, pairs_back
from dist_moe.dispatch.apply_experts import apply_experts, apply_experts_in_order, compute_dtype
from dist_moe.dispatch.combine import row_places, sum_rows
from dist_moe.dispatch.contract import ExpertsContract
from dist_moe.dispatch.profiling import profiled
from dist_moe.dispatch.weight_casts import one_cast_per_forward
from dist_moe.dispatch.wire import Wire
from dist_moe.distributed.collective_order import exchange_done, exchange_recorded


def check_chunks(chunks) -> int:
    """A layer's ``pipeline_chunks``: an int in [1, MAX_PIPELINE_CHUNKS] (the same on every rank), or
    ValueError naming it."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= MAX_PIPELINE_CHUNKS:
        raise ValueError(f"pipeline_chunks must be an int in [1, {MAX_PIPELINE_CHUNKS}], got {chunks!r}")
    return chunks


def chunk_bounds(tokens: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous token ranges, sizes differing by at most one (some empty if few tokens)."""
    base, extra = divmod(tokens, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass(frozen=True)
class RowPolicy:
    """How an exchange's rows are summed and carried: ``fixed_order`` sums every row (a copy's pairs, a token's
    copies, their gradients) in a fixed order (``combine.py``), each row taking at most ``top_k``, instead of
    with index_add; ``wire`` is what rows travel in (None: the rows' own dtype)."""

    top_k: int = 1
    fixed_order: bool = False
    wire: Wire | None = None


class PipelineRun:
    """One forward's hops and the per-chunk graphs its backward needs."""

    def __init__(self, first: list[Hop], second, experts: ExpertsContract, slot_of: Tensor, tagged: bool,
                 side: nn.Module | None, rows: RowPolicy | None = None):
        """``second``: node dedup's second hops, or what plans them (called once the first hop's payload has
        left), or None."""
        self.first, self.second = first, second
        rows = rows or RowPolicy()
        self.top_k, self.fixed_order, self.wire = rows.top_k, rows.fixed_order, rows.wire
        self.experts, self.slot_of, self.tagged, self.side = experts, slot_of, tagged, side
        # the trainable tensors the backward returns gradients for
        self.params: list[Tensor] = [p for p in experts.template().values() if p.requires_grad]
        self.side_params: list[Tensor] = [] if side is None else [p for p in side.parameters() if p.requires_grad]
        self.train = False
        self.leaves: list[Tensor] = []  # per forward: the weights every chunk runs on (see ``_weights``)
        self.saved: list[Tensor] = []  # (h, side output) if a side; then per chunk (copies, gates, expert output)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor | None]:
        dtype, self.width = h.dtype, h.shape[1]
        wire = self.wire_now = self.wire or Wire(dtype)  # resolved once: the backward sends in its rows' dtype
        if wire.fp8 and getattr(self.experts, "capture", None) is not None:
            raise ValueError("wire_dtype fp8 rounds the experts' inputs, which GAR's factor capture records "
                             "exactly: use wire_dtype auto, fp32 or bf16 with GAR")
        self.compute = compute_dtype(h)  # what the experts compute in, whatever the rows travel in
        self.weights = self._weights(h)
        rows = wire.pack(h)
        sent = [hop.out(rows[hop.copy_row]) for hop in self.first]
        if callable(self.second):  # node dedup's second hop, planned while the first's payload is in flight
            with profiled("plan_inner"):
                self.second = self.second()
        with profiled("shared_expert"):
            side = self._side(h)
        with one_cast_per_forward():  # an engine's experts cast their weights for the first chunk only
            back = self._each_chunk(sent, lambda hop, x: self._experts(x, hop), wire.rows,
                                    ("dispatch_wait", "dispatch_wait_inner", "combine_wait_inner"))
        got = [_wait(pending, "combine_wait") for pending in back]
        with profiled("combine"):
            out = self._sum_rows(got, [hop.copy_row for hop in self.first], h.shape[0])
        return out.to(dtype), side

    def _each_chunk(self, arrived: list, compute, dtype, waits: tuple) -> list:
        """Every chunk in turn: wait for its rows (``arrived``), run ``compute(hop, rows)`` on them (with
        node dedup, on the rows forwarded inside the node, whose results come back to this gateway),
        and start the result back the way the rows came, in ``dtype``; returns those sends. With node dedup a
        chunk's results from inside the node are waited for one chunk later, after this gateway has
        computed the next chunk, so the two gateways of a node do not wait on each other's experts for
        every chunk. ``waits`` name the waits: rows, rows inside the node, results inside the node."""
        outer, inner_rows, inner_results = waits
        out, held = [], None
        for i, (hop, pending) in enumerate(zip(self.first, arrived)):
            rows = _wait(pending, outer)
            if self.second is None:
                out.append(hop.back(compute(hop, rows).to(dtype)))
                continue
            inner = self.second[i]
            y = compute(inner, _wait(inner.out(rows[inner.copy_row]), inner_rows))
            now = (i, inner.back(y.to(dtype)), rows.shape[0])
            if held is not None:
                out.append(self._through_node(held, inner_results, dtype))
            held = now
        if held is not None:
            out.append(self._through_node(held, inner_results, dtype))
        return out

    def _through_node(self, held: tuple, wait: str, dtype) -> Pending:
        """One chunk's results from inside the node, summed per received copy and started back."""
        i, pending, rows = held
        y = self._sum_rows([_wait(pending, wait)], [self.second[i].copy_row], rows)
        return self.first[i].back(y.to(dtype))

    def _sum_rows(self, values: list[Tensor], rows: list[Tensor], num_rows: int) -> Tensor:
        """fp32 [num_rows, width]: each row the sum of the ``values`` rows sent for it (``rows``: which)."""
        if self.fixed_order:
            index = torch.cat(rows)
            return sum_rows(torch.cat(values).float(), row_places(index, num_rows, self.top_k), num_rows, self.top_k)
        out = values[0].new_zeros((num_rows, values[0].shape[1]), dtype=torch.float32)
        for index, v in zip(rows, values):
            out.index_add_(0, index, v.float())
        return out

    def _weights(self, h: Tensor) -> dict:
        """dist-moe's experts run every chunk on one copy of their weights, cut from the graph and
        cast to the compute dtype once per forward (bf16 under autocast), so a chunk's backward gives
        the gradient of that copy alone, which ``backward`` adds into one fp32 buffer per weight."""
        self.leaves = []
        if not getattr(self.experts, "takes_weights", False):  # an engine's experts keep their own parameters
            return {}
        dtype = compute_dtype(h)
        slots = [n for n, p in self.experts.template().items() if p.requires_grad]
        self.leaves = [p.detach().to(dtype).requires_grad_(self.train) for p in self.params]
        return {"weights": dict(zip(slots, self.leaves))}

    def _experts(self, x: Tensor, hop: Hop) -> Tensor:
        """This rank's experts on one received chunk: one row per received copy, summed in fp32 and kept
        (with the rows) in the dtype they travel in."""
        tags = hop.copy_meta[:, -1] if self.tagged else None  # the last meta column holds row tags
        gate = hop.pair_gate
        x = self.wire_now.unpack(x, self.width)  # fp8: dequantized here, its gradient that of a plain cast
        if self.train:
            x, gate = x.detach().requires_grad_(), gate.detach().requires_grad_()
        with torch.set_grad_enabled(self.train), profiled("experts"):
            slot, rows = self.slot_of[hop.pair_expert], x.to(self.compute)
            if self.fixed_order:  # a copy takes at most top_k pairs
                y = apply_experts_in_order(self.experts, rows, (hop.pair_copy, slot, gate), self.top_k, tags,
                                           counts=hop.expert_counts, **self.weights)
            else:
                y = apply_experts(self.experts, rows, hop.pair_copy, slot, gate, tags, counts=hop.expert_counts,
                                  **self.weights)
            y = y.to(x.dtype)
        if self.train:
            self.saved += [x, gate, y]
        return y.detach()

    def _side(self, h: Tensor) -> Tensor | None:
        if self.side is None:
            return None
        if not self.train:
            return self.side(h)
        with torch.enable_grad():
            leaf = h.detach().requires_grad_()
            y = self.side(leaf)
        self.saved += [leaf, y]
        return y.detach()

    def backward(self, saved: tuple, grad_out: Tensor, grad_side: Tensor | None, h_shape, dtype,
                 gates_numel: int) -> tuple:
        wire = self.wire_now.rows  # an fp8 wire's backward: bf16
        returned = [hop.out(grad_out[hop.copy_row].to(wire)) for hop in self.first]
        side_saved, chunks = (saved[:2], saved[2:]) if self.side is not None else ((), saved)  # as _side saved
        inner = iter(zip(chunks[0::3], chunks[1::3], chunks[2::3]))
        # summed over the chunks in fp32 whatever the parameters' dtype (an engine's may be bf16), cast once at the end
        param_grads = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        wrt = self.leaves or self.params  # what each chunk's graph holds: the cast copies, or the parameters
        grad_h = torch.zeros(h_shape, dtype=torch.float32, device=grad_out.device)
        with profiled("backward.shared_expert"):
            side_grads = self._side_backward(side_saved, grad_side, grad_h)
        gate_grads = []

        def chunk_backward(hop, gy):
            gx, gg = _expert_grads(next(inner), gy, wrt, param_grads)
            gate_grads.append(gg)  # in chunk order
            return gx

        sent_rows = self._each_chunk(returned, chunk_backward, wire, ("backward.combine_wait",
                                     "backward.combine_wait_inner", "backward.dispatch_wait_inner"))
        # gate gradients are 4 bytes a pair: each hop returns every chunk's in one all-to-all
        if self.second is not None:
            gate_grads = [back.new_zeros(hop.pair_gate.shape).index_put_((hop2.sent_pairs,), back) for hop, hop2, back
                          in zip(self.first, self.second, _wait(pairs_back(self.second, gate_grads),
                                                                "backward.gate_grads_wait"))]
        gates_back = pairs_back(self.first, gate_grads)
        grad_gates = torch.zeros(gates_numel, dtype=torch.float32, device=grad_out.device)
        rows = [_wait(pending, "backward.dispatch_wait") for pending in sent_rows]
        with profiled("backward.combine"):
            grad_h += self._sum_rows(rows, [hop.copy_row for hop in self.first], h_shape[0])
        for hop, back in zip(self.first, _wait(gates_back, "backward.gate_grads_wait")):
            grad_gates.index_put_((hop.sent_pairs,), back)
        self.leaves = []
        param_grads = [g.to(p.dtype) for g, p in zip(param_grads, self.params)]
        return grad_h.to(dtype), grad_gates, param_grads, side_grads

    def _side_backward(self, saved: tuple, grad_side: Tensor | None, grad_h: Tensor) -> list:
        if self.side is None:
            return []
        if grad_side is None:
            return [None] * len(self.side_params)
        leaf, y = saved
        grads = torch.autograd.grad(y, [leaf, *self.side_params], grad_side, retain_graph=True, allow_unused=True)
        if grads[0] is not None:
            grad_h += grads[0].float()
        return list(grads[1:])


def _wait(pending, name: str):
    """``pending.wait()`` as a named range (an exchange's wait, or a merged one's)."""
    with profiled(name):
        return pending.wait()


def _expert_grads(saved, grad_y: Tensor, params: list[Tensor], param_grads: list[Tensor]):
    """One chunk's expert backward: gradients of its copies and gates; expert weights' added into
    ``param_grads`` (fp32, one buffer each, whatever dtype the chunk computed in)."""
    x, gate, y = saved
    with profiled("backward.experts"):
        grads = torch.autograd.grad(y, [x, gate, *params], grad_y.to(y.dtype), retain_graph=True, allow_unused=True)
    for acc, g in zip(param_grads, grads[2:]):
        if g is not None:
            acc += g
    gx = torch.zeros_like(x) if grads[0] is None else grads[0]
    return gx, (torch.zeros_like(gate) if grads[1] is None else grads[1])


class _Pipelined(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: PipelineRun, _anchor, h, gates, *params):
        out, side = run.forward(h)
        ctx.run, ctx.shape = run, (h.shape, h.dtype, gates.shape, gates.dtype)
        # saved, not kept on ctx: the per-chunk graphs are freed with the outer graph's buffers
        ctx.save_for_backward(*run.saved)
        run.saved = []
        return (out,) if side is None else (out, side)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_side=None):
        h_shape, dtype, g_shape, g_dtype = ctx.shape
        if grad_out is None:  # still take part: every rank runs the same collectives
            grad_out = torch.zeros(h_shape, dtype=dtype, device=ctx.run.slot_of.device)
        grad_h, grad_g, param_grads, side_grads = ctx.run.backward(ctx.saved_tensors, grad_out, grad_side, h_shape,
                                                                   dtype, g_shape.numel())
        exchange_done(ctx.run)  # every collective of this backward issued and waited
        return None, None, grad_h, grad_g.reshape(g_shape).to(g_dtype), *param_grads, *side_grads


def run_pipeline(run: PipelineRun, h: Tensor, gates: Tensor) -> tuple[Tensor, Tensor | None]:
    """(routed output [T, H], shared expert output or None), differentiable in h, gates and weights."""
    run.train = torch.is_grad_enabled()
    anchor = torch.zeros((), device=h.device, requires_grad=run.train)
    outs = _Pipelined.apply(run, anchor, h, gates, *run.params, *run.side_params)
    if run.train:  # its backward's collectives come before any gradient sum (collective_order.py)
        exchange_recorded(run)
    return outs[0], (outs[1] if len(outs) > 1 else None)
