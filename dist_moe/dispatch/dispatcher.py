"""Expert-parallel dispatch over a process group, with rank or node dedup.

A *copy* is one token row sent to one rank; a *pair* is one (selected expert,
gate) attached to a copy. The destination applies every pair's expert to its
copy and reduces the gated outputs into one row, which returns the way it came.

none   one copy per pair (what DeepSpeed and Megatron send)
rank   one copy per (token, destination rank)
node   hop 1: one copy per (token, destination node) to the rank on that node
       with the sender's local index (the gateway; the sender itself for its own
       node); hop 2: each gateway forwards one copy per destination rank inside
       its node. The combine reduces inside the node before crossing back.

The plan comes from ``placement.plan`` (the same one ``dispatch_traffic`` counts);
each exchange reads back to the host once, its split sizes for every chunk
(``all_to_all.plan_hops``), so a forward blocks the host once per exchange (twice
with node dedup) and the backward not at all. The payloads move in ``chunks``
token chunks, each in flight while the experts run another (``pipeline.py``).
Outputs accumulate in fp32 and are cast once.

Every exchange records the payload bytes it sends to each peer in ``traffic``
(this rank's row), so summed over ranks the measured matrix equals
``placement.dispatch_traffic`` for the same routings. Routing metadata travels
beside the payload and is counted separately in ``metadata_bytes`` (to other
ranks only): per pair 16 bytes (its copy index; its expert id and gate packed in one
int64), per copy its integer tags (categories, row tags) at 8 bytes each.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dist_moe.dispatch.all_to_all import Chunk, plan_hops
from dist_moe.dispatch.apply_experts import apply_experts, apply_experts_in_order, compute_dtype
from dist_moe.dispatch.combine import take_rows
from dist_moe.dispatch.contract import ExpertsContract, Routes, Tokens
from dist_moe.dispatch.pipeline import PipelineRun, RowPolicy, chunk_bounds, run_pipeline
from dist_moe.dispatch.profiling import profiled
from dist_moe.dispatch.wire import check_wire_dtype, wire_dtype
from dist_moe.distributed.groups import SUBGROUPS, WeakGroup
from placement import Placement, Topology
from placement.plan import DispatchPlan, Exchange, check_dedup


def kept_pairs(expert_idx: Tensor, gates: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The [T, K] routing's kept (not dropped) slots as pairs: (place, expert, gate), a pair's place its
    index t * K + j in the flat routing (its token is place // K). One host read: how many are kept."""
    place = torch.nonzero(expert_idx.reshape(-1) >= 0).squeeze(1)
    # gathered by index, not by mask: the backward puts each gate's gradient back without accumulating
    return place, expert_idx.reshape(-1)[place], take_rows(gates.reshape(-1), place, place, 1)


def routing_pairs(expert_idx: Tensor, gates: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Flatten [T, K] routing into (token, expert, gate) pairs, leaving out dropped slots."""
    place, expert, gate = kept_pairs(expert_idx, gates)
    return place // expert_idx.shape[1], expert, gate


def every_slot_pairs(expert_idx: Tensor, gates: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Every [T, K] slot as a pair, so their number is known without reading the routing back: a
    dropped slot (-1) goes to expert 0 with gate 0, which costs its expert one row and adds 0."""
    t, k = expert_idx.shape
    dropped = expert_idx < 0
    token = torch.arange(t, device=expert_idx.device).repeat_interleave(k)
    return token, expert_idx.clamp(min=0).reshape(-1), gates.masked_fill(dropped, 0.0).reshape(-1)


class LocalDispatcher:
    """The dispatcher when every expert is on this rank (one process, or one expert-parallel rank):
    nothing is exchanged, so there is nothing to agree on (the router checks its own input). Experts
    run once each on their contiguous slice of the rows, grouped with one sort."""

    exchanges = False
    rank = 0
    row_bytes = None  # nothing is sent
    metadata_bytes = 0

    def __init__(self, placement: Placement, fixed_order: bool = False):
        """``fixed_order``: sum each token's expert outputs (and its gradient rows) in a fixed order
        (``combine.py``), so reruns on a GPU repeat bit for bit; it costs a few percent of the layer
        (an extra pass over the [T * K, H] rows), so only deterministic runs ask for it."""
        self.placement = placement  # its slot table maps expert ids to this rank's slots
        self.fixed_order = fixed_order

    def dispatch(self, tokens: Tokens, routing: Routes, chunks: int = 1) -> LocalDispatch:
        """Nothing travels: the tokens stay, their pairs are made once the experts are known."""
        return LocalDispatch(tokens, routing, self.placement, self.fixed_order)

    def __call__(self, tokens: Tokens, routing: Routes, experts, chunks: int = 1,
                 shared: nn.Module | None = None) -> tuple[Tensor, Tensor | None]:
        return self.dispatch(tokens, routing, chunks).experts_and_combine(experts, shared)

    @property
    def traffic(self) -> Tensor:
        return torch.zeros(self.placement.world_size, self.placement.world_size, dtype=torch.long)

    def reset_traffic(self) -> None:
        pass


class LocalDispatch:
    """One forward's tokens when every expert is on this rank."""

    def __init__(self, tokens: Tokens, routing: Routes, placement: Placement, fixed_order: bool):
        self.tokens, self.routing, self.placement, self.fixed_order = tokens, routing, placement, fixed_order

    def experts_and_combine(self, experts, shared: nn.Module | None = None) -> tuple[Tensor, Tensor | None]:
        """(y [T, H] each token's gated expert outputs summed, ``shared(h)`` or None)."""
        h, row_tags = self.tokens.h, self.tokens.row_tags
        x = h.to(compute_dtype(h))  # cast once, before the rows are gathered k times
        expert_idx, gates = self.routing.expert_idx, self.routing.gates
        t, k = expert_idx.shape
        # every slot a pair (a dropped one adds 0): their number is known without a host read; grouped experts
        # size their groups on the device, a loop reads its counts once (slot_counts)
        token, expert, gate = every_slot_pairs(expert_idx, gates)
        place = torch.arange(t * k, device=h.device)
        slot = self.placement.slot_table(h.device)[expert]
        with profiled("experts"):
            if self.fixed_order:  # a token's k outputs summed in its routing's slot order (place t * k + j)
                y = apply_experts_in_order(experts, x, (token, slot, gate), k, row_tags, places=place)
            else:  # index_add: with atomics on a GPU
                y = apply_experts(experts, x, token, slot, gate, row_tags)
        return y.to(h.dtype), None if shared is None else shared(h)  # y accumulated in fp32


def make_dispatcher(group, placement: Placement, topology: Topology, dedup: str = "rank", timeout=None,
                    fixed_order: bool = False, wire_dtype: str = "auto"):
    """``ExpertParallelDispatcher`` over ``group`` when it has more than one rank, else ``LocalDispatcher``
    (``fixed_order``, ``wire_dtype``: see there; nothing travels locally)."""
    world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    if world == 1:
        return LocalDispatcher(placement, fixed_order)
    if topology.effective_dedup(check_dedup(dedup)) == "node" and world != dist.get_world_size():
        # node groups are made collectively over the world's ranks: an EP group of part of it cannot make them
        raise ValueError(f"dedup='node' needs the expert-parallel group to be the whole world ({world} of "
                         f"{dist.get_world_size()} ranks); use dedup='rank'")
    return ExpertParallelDispatcher(group, placement, topology, dedup, timeout, fixed_order, wire_dtype)


def node_subgroup(group, topology: Topology, timeout=None):
    """This rank's node as a process group, created once per (group, node layout, timeout).

    Creating groups is collective over ``group``: every rank creates every node's
    group, in the same order, so every rank of the group must build its node-dedup
    layers in the same order (as with any ``new_group``). Groups made with
    ``use_local_synchronization`` would avoid that, but with gloo on torch 2.13
    they aborted at process exit in about one run in twelve, so they are not used.
    ``timeout`` (a timedelta) bounds the group's collectives; None keeps torch's
    default (30 minutes for gloo), never infinite.
    """
    rank = dist.get_rank(group)
    node, g = topology.node_of(rank), topology.ranks_per_node
    key = ("node", id(group), topology.num_nodes, g, node, timeout)
    mine = SUBGROUPS.get(key)
    if mine is None:
        for other in range(topology.num_nodes):
            ranks = [dist.get_global_rank(group, other * g + i) for i in range(g)]
            sub = dist.new_group(ranks, timeout=timeout)
            if other == node:
                mine = SUBGROUPS[key] = sub
    return mine


class ExpertParallelDispatcher:
    exchanges = True
    group = WeakGroup()  # both held weakly: torch.distributed owns them (groups.py)
    node_group = WeakGroup()

    def __init__(self, group, placement: Placement, topology: Topology, dedup: str = "rank", timeout=None,
                 fixed_order: bool = False, wire_dtype: str = "auto"):
        self.group = group
        self.fixed_order = fixed_order  # the pipeline's sums of rows (LocalDispatcher's)
        self.wire_dtype = check_wire_dtype(wire_dtype)  # what rows travel in (wire.py)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        topology.check_ranks(self.world)
        placement.check(placement.num_experts, self.world)
        # the mode it runs: node dedup on one node (or one rank per node) is rank dedup, no second hop
        self.dedup = topology.effective_dedup(check_dedup(dedup))
        self.placement, self.topology = placement, topology
        self.rank_of = placement.rank_table(torch.device("cpu"))
        self.slot_of = placement.slot_table(torch.device("cpu"))
        self.num_local = placement.num_experts // self.world
        self.g = topology.ranks_per_node
        self.node_group = node_subgroup(group, topology, timeout) if self.dedup == "node" else None
        self.calls = 0
        self.row_bytes: int | None = None  # bytes of one dispatched row at the last forward (its wire's)
        self.reset_traffic()

    def reset_traffic(self) -> None:
        # host ints: the counts are host ints already, and a ledger that builds no tensor during a
        # forward cannot stall the device (tests/train/test_sync_budget.py counts every build)
        self._sent_bytes = [0] * self.world
        self.metadata_bytes = 0

    @property
    def traffic(self) -> Tensor:
        """[W, W] int64: payload bytes this rank sent to each peer since the last reset (its row)."""
        matrix = torch.zeros(self.world, self.world, dtype=torch.long)
        matrix[self.rank] = torch.tensor(self._sent_bytes, dtype=torch.long)
        return matrix

    def _record(self, hops: list, peer_base: int, row_bytes: int, copy_meta_bytes: int) -> None:
        """Add what one exchange (all its chunks) sent to peers ``peer_base + i`` (host counts; this
        rank's own copies stay)."""
        copies = [sum(c) for c in zip(*(hop.send_c for hop in hops))]
        pairs = [sum(p) for p in zip(*(hop.send_p for hop in hops))]
        mine = self.rank - peer_base
        sent = [0 if i == mine else c for i, c in enumerate(copies)]
        for i, c in enumerate(sent):
            self._sent_bytes[peer_base + i] += c * row_bytes
        own_pairs = pairs[mine] if 0 <= mine < len(pairs) else 0
        # per pair 16 B: its copy id; its expert id and gate in one int64
        self.metadata_bytes += sum(sent) * copy_meta_bytes + (sum(pairs) - own_pairs) * 16

    def _index_tensors(self, device):
        if self.rank_of.device != device:  # the placement's tables for this device, made once per device
            self.rank_of, self.slot_of = self.placement.rank_table(device), self.placement.slot_table(device)
        return self.rank_of, self.slot_of

    def dispatch(self, tokens: Tokens, routing: Routes, chunks: int = 1) -> ExpertParallelDispatch:
        """``tokens.h`` [T, H] this rank's tokens, their routes sent: every rank learns how many rows and
        pairs it receives from each peer, chunk by chunk, and the pairs' expert ids, gates and tags.

        ``tokens.copy_meta`` [T] or [T, C] integers travel with each copy (categories);
        ``tokens.row_tags`` [T] too, and reach the experts' capture at the destination.
        ``tokens.tag`` (the caller's forward count; None: this dispatcher's call count) and
        ``tokens.problem`` (``agree.input_problem``) ride with the split sizes: a problem on any rank,
        or ranks at different tags, raise on every rank before a token moves (``agree.py``).
        ``chunks`` > 1 pipelines the payload by token (``pipeline.py``; every rank of the group
        must pass the same number).
        """
        h, expert_idx, gates = tokens.h, routing.expert_idx, routing.gates
        copy_meta, row_tags, problem = tokens.copy_meta, tokens.row_tags, tokens.problem
        self.calls += 1
        tag = self.calls if tokens.tag is None else tokens.tag
        rank_of, slot_of = self._index_tensors(h.device)
        t, k = expert_idx.shape
        parts = [(m.unsqueeze(1) if m.dim() == 1 else m).long() for m in (copy_meta, row_tags) if m is not None]
        meta = torch.cat(parts, 1) if parts else h.new_zeros((t, 0), dtype=torch.long)
        pair_expert, pair_gate = expert_idx.reshape(-1), gates.reshape(-1)
        wire = wire_dtype(self.wire_dtype, h)
        row_bytes = self.row_bytes = wire.dispatch_row_bytes(h.shape[1])  # the routing record's token bytes
        with profiled("plan"):  # the split sizes' exchange (its one host read) and the routing metadata's
            chunked: list = []
            for a, b in chunk_bounds(t, chunks):
                plan = DispatchPlan.build(expert_idx[a:b], self.placement, self.topology, self.dedup, self.rank,
                                          local=True)
                chunked.append(Chunk(plan.hops[0], plan.pair_token + a, pair_expert[a * k:b * k],
                                     pair_gate[a * k:b * k], meta, a * k))
            first = plan_hops(self.group, chunked, slot_of, self.num_local, tag, problem, wire.code)
            self._record(first, 0, row_bytes, 8 * meta.shape[1])
        # node dedup's second hop is planned from the pairs the first delivers: while its payload crosses
        second = (lambda: self._second_hop(first, tag, row_bytes, wire.code)) if self.dedup == "node" else None
        return ExpertParallelDispatch(h, gates, first, second, slot_of, row_tags is not None,
                                      RowPolicy(k, self.fixed_order, wire))

    def __call__(self, tokens: Tokens, routing: Routes, experts: ExpertsContract, chunks: int = 1,
                 shared: nn.Module | None = None) -> tuple[Tensor, Tensor | None]:
        """``dispatch`` then ``experts_and_combine``: (y [T, H] sum of gated expert outputs per token,
        ``shared(h)`` or None)."""
        return self.dispatch(tokens, routing, chunks).experts_and_combine(experts, shared)

    def _second_hop(self, first: list, tag: int, row_bytes: int, wire: int) -> list:
        """Node dedup's second hop on the gateway: one copy per destination rank inside this node."""
        node_base = self.topology.node_of(self.rank) * self.g
        chunks = [Chunk(Exchange.group(hop.pair_copy, self.rank_of[hop.pair_expert] - node_base, self.g,
                                       sum(hop.recv_c)), hop.pair_copy, hop.pair_expert, hop.pair_gate,
                        hop.copy_meta) for hop in first]
        second = plan_hops(self.node_group, chunks, self.slot_of, self.num_local, tag, wire=wire)
        self._record(second, node_base, row_bytes, 8 * first[0].copy_meta.shape[1])
        return second


class ExpertParallelDispatch:
    """One forward's tokens with their routes delivered and the payload's hops planned; the payload
    itself has not moved yet."""

    def __init__(self, h: Tensor, gates: Tensor, first: list, second, slot_of: Tensor, tagged: bool,
                 rows: RowPolicy):
        self.h, self.gates, self.first, self.second = h, gates, first, second
        self.slot_of, self.tagged, self.rows = slot_of, tagged, rows

    def experts_and_combine(self, experts: ExpertsContract,
                            shared: nn.Module | None = None) -> tuple[Tensor, Tensor | None]:
        """Each chunk's rows sent, the experts run on them as they arrive, their gated outputs combined
        back: (y [T, H] summed per token, ``shared(h)`` or None; the shared experts run while the first
        chunks are in flight). The three overlap chunk by chunk inside one autograd node
        (``pipeline.py``), so the backward's collectives keep one order on every rank."""
        run = PipelineRun(self.first, self.second, experts, self.slot_of, self.tagged, shared, self.rows)
        y, shared_y = run_pipeline(run, self.h, self.gates)
        return y, None if shared is None else shared_y
