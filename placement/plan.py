"""One dispatch plan: which copy of which row goes to which rank, and the (expert, gate) pairs on it.

The dispatcher executes it and ``dispatch_traffic`` counts bytes from it, so the none / rank /
node rules are written once (the byte rules of ``traffic.py``):

none   one copy per pair (token, selected expert) to the expert's rank
rank   one copy per (token, destination rank)
node   hop 1: one copy per (token, destination node) to the gateway, the rank on that node
       with the source's local index (the source itself for its own node); hop 2: the
       gateway sends one copy per (token, destination rank) inside its node

An ``Exchange`` is one all-to-all's worth: pairs grouped into copies by (destination, row),
computed with fixed-size tensor ops only (a stable sort, a cumulative sum, scatter-adds), so
on a GPU nothing here reads back to the host. Dropped pairs (expert -1) go to a sentinel
destination past the last rank: they sort last and are never sent. The one host read an
exchange needs, the split sizes, happens in the dispatcher, with the counts exchange.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from placement.names import DEDUP_MODES
from placement.placement import Placement
from placement.topology import Topology


def check_dedup(dedup: str) -> str:
    if dedup not in DEDUP_MODES:
        raise ValueError(f"dedup must be one of {DEDUP_MODES}, got {dedup!r}")
    return dedup


@dataclass
class Exchange:
    """Pairs grouped into copies for one all-to-all over ``num_dst`` destinations.

    Copies are numbered in (destination, row) order; the sorted pairs of one copy are
    consecutive, and the pairs of destination d are consecutive too (sentinel last).
    """

    num_dst: int
    order: Tensor  # [P] pair indices sorted by (destination, row)
    dst: Tensor  # [P] destination of each sorted pair (num_dst: dropped)
    copy: Tensor  # [P] copy index of each sorted pair
    leader: Tensor  # [P] bool, the first sorted pair of its copy
    copies_per_dst: Tensor  # [num_dst] copies to each destination
    pairs_per_dst: Tensor  # [num_dst] pairs to each destination

    @classmethod
    def group(cls, pair_row: Tensor, pair_dst: Tensor, num_dst: int, num_rows: int | None) -> Exchange:
        """Group pairs (row, destination) into copies: one per distinct (row, destination) given
        ``num_rows`` (rank and node dedup), one per pair with None (no dedup). ``pair_dst`` ==
        ``num_dst`` marks a pair that is not sent."""
        p = pair_row.shape[0]
        if num_rows is None:
            key = pair_dst * max(p, 1) + torch.arange(p, device=pair_row.device)
        else:
            key = pair_dst * max(num_rows, 1) + pair_row
        order = torch.argsort(key, stable=True)
        ks = key[order]
        leader = torch.ones(p, dtype=torch.bool, device=key.device)
        if p > 1:
            leader[1:] = ks[1:] != ks[:-1]
        dst = pair_dst[order]
        counts = torch.zeros(2, num_dst + 1, dtype=torch.long, device=key.device)
        counts[0].scatter_add_(0, dst, leader.long())
        counts[1].scatter_add_(0, dst, torch.ones_like(dst))
        return cls(num_dst, order, dst, torch.cumsum(leader, 0) - 1, leader, counts[0, :num_dst],
                   counts[1, :num_dst])

    def copy_start(self) -> Tensor:
        """[num_dst] index of each destination's first copy."""
        return torch.cumsum(self.copies_per_dst, 0) - self.copies_per_dst

    def local_copy(self) -> Tensor:
        """[P] each sorted pair's copy index inside its destination's chunk (0 for dropped pairs)."""
        start = torch.cat([self.copy_start(), self.copies_per_dst.sum().reshape(1)])
        return self.copy - start[self.dst]

    def copy_values(self, pair_values: Tensor, num_copies: int) -> Tensor:
        """A per-pair value (the same for every pair of a copy, e.g. its row) for each of the first
        ``num_copies`` copies; duplicate writes of equal values, so the scatter is exact."""
        out = pair_values.new_zeros(max(self.order.shape[0], 1))
        return out.scatter(0, self.copy, pair_values[self.order])[:num_copies]


def destination_ranks(expert_idx: Tensor, placement: Placement, world: int | None = None) -> Tensor:
    """Rank of each selected expert; ``world`` (the sentinel) for dropped slots (-1)."""
    ranks = placement.rank_table(expert_idx.device)
    world = placement.world_size if world is None else world
    return torch.where(expert_idx >= 0, ranks[expert_idx.clamp_min(0)], world)


def gateways(dst_rank: Tensor, src_rank: Tensor, topology: Topology) -> Tensor:
    """Node dedup's first-hop destination: the rank on ``dst_rank``'s node with the source's local index."""
    g, w = topology.ranks_per_node, topology.world_size
    return torch.where(dst_rank < w, (dst_rank // g) * g + src_rank % g, w)


@dataclass
class DispatchPlan:
    """Every exchange of one forward dispatch, for tokens of any source ranks (the analytic view).

    ``hops[i]`` groups the pairs of hop i: its copies go from ``senders[i]`` (per pair) to
    the hop's destinations. The dispatcher executes the same derivation on one rank: hop 1
    from its own tokens, hop 2 (node dedup) on each gateway from the pairs it received.
    """

    dedup: str
    world: int
    pair_token: Tensor  # [P] token of each pair (all pairs, dropped ones included)
    hops: list  # [Exchange]
    senders: list  # [P] rank sending each pair in that hop (input order)
    receivers: list  # [P] rank receiving each pair in that hop (input order; world = not sent)

    @classmethod
    def build(cls, expert_idx, placement: Placement, topology: Topology, dedup: str = "rank",
              src_rank=0, local: bool = False) -> DispatchPlan:
        """``local``: only what the source rank sends itself (the dispatcher's view: node dedup's
        hop 2 runs on the gateways, grouped from the pairs they receive)."""
        dedup = topology.effective_dedup(check_dedup(dedup))
        w = topology.world_size
        if placement.world_size != w:
            raise ValueError(f"placement has {placement.world_size} ranks, topology {w}")
        expert_idx = torch.as_tensor(expert_idx).long()
        if expert_idx.dim() != 2:
            raise ValueError(f"expert_idx must be [T, K], got shape {tuple(expert_idx.shape)}")
        t, k = expert_idx.shape
        if isinstance(src_rank, numbers.Integral):  # filled on the device: no host-to-device copy on a GPU
            src = torch.full((t,), int(src_rank), dtype=torch.long, device=expert_idx.device)
        else:
            src = torch.as_tensor(src_rank, dtype=torch.long, device=expert_idx.device)
            src = src.expand(t) if src.dim() == 0 else src
        if src.shape != (t,):
            raise ValueError(f"src_rank must be an int or a [T] tensor, got shape {tuple(src.shape)}")
        token = torch.arange(t, device=expert_idx.device).repeat_interleave(k, output_size=t * k)
        dst = destination_ranks(expert_idx.reshape(-1), placement, w)
        pair_src = src[token]
        if dedup != "node":
            hop = Exchange.group(token, dst, w, t if dedup == "rank" else None)
            return cls(dedup, w, token, [hop], [pair_src], [dst])
        gate = gateways(dst, pair_src, topology)
        hop1 = Exchange.group(token, gate, w, t)
        if local:
            return cls(dedup, w, token, [hop1], [pair_src], [gate])
        hop2 = Exchange.group(token, dst, w, t)  # (token, rank) is (gateway copy, rank)
        return cls(dedup, w, token, [hop1, hop2], [pair_src, torch.where(dst < w, gate, w)], [gate, dst])

    def sent(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """Hop ``i``'s copies as (sender, receiver, sent) per sorted pair: ``sent`` marks one pair per
        copy that crosses to another rank (a copy is a leader pair; what a rank keeps, and dropped
        pairs, are not sent). Every count of copies and bytes starts here."""
        hop, w = self.hops[i], self.world
        s, r = self.senders[i][hop.order].cpu(), self.receivers[i][hop.order].cpu()
        return s, r, hop.leader.cpu() & (r < w) & (s < w) & (s != r)

    def traffic_matrix(self, token_bytes: int) -> Tensor:
        """[W, W] int64 payload bytes, sender row -> receiver column; nothing a rank keeps is counted."""
        w = self.world
        matrix = torch.zeros(w * w + 1, dtype=torch.long)
        for i in range(len(self.hops)):
            s, r, send = self.sent(i)
            cell = torch.where(send, s * w + r, w * w)  # the sentinel cell collects what is not sent
            matrix.scatter_add_(0, cell, send.long() * token_bytes)
        return matrix[: w * w].reshape(w, w)

    def copies_by_level(self, topology: Topology) -> list[dict]:
        """Per hop: {level: (copies, [W] copies each rank sends, [W] copies each receives)}, every copy
        counted at the level its two ranks' coordinates cross (no [W, W] matrix: 16,384 ranks plan fast)."""
        hops = []
        for i in range(len(self.hops)):
            s, r, send = self.sent(i)
            s, r = s[send], r[send]
            level = topology.crossing_levels(s, r)
            hops.append({name: (int((level == j).sum()), torch.bincount(s[level == j], minlength=self.world),
                                  torch.bincount(r[level == j], minlength=self.world))
                           for j, name in enumerate(topology.levels)})
        return hops
