"""Exact byte accounting of expert-parallel dispatch (DESIGN 3.2 byte rules).

Payload only: ``token_bytes = hidden_size * element_size``; routing metadata is
counted separately by the dispatcher and never mixed in. Bytes that stay on
their source rank are not counted. The combine direction carries the same
bytes as dispatch in every mode (partial sums are reduced before travelling).

none   one copy per (token, selected expert) whose expert lives on another rank
rank   one copy per distinct destination rank other than the source
node   one copy per distinct destination node other than the source's, sent to
       the rank on that node with the source's local index (the gateway), which
       forwards one copy per distinct destination rank on its node other than
       itself (counted on the gateway's row); destinations on the source's own
       node get one copy per distinct rank, as in ``rank``
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from placement.placement import Placement
from placement.topology import Topology

DEDUP_MODES = ("none", "rank", "node")


@dataclass
class Traffic:
    matrix: Tensor  # [W, W] int64 bytes, source row -> destination column
    topology: Topology

    def by_level(self) -> dict:
        """{level name: bytes} for every level (0 where nothing crossed it)."""
        level = self.topology.level_matrix()
        return {name: int(self.matrix[level == i].sum()) for i, name in enumerate(self.topology.levels)}

    @property
    def total(self) -> int:
        return int(self.matrix.sum())

    @classmethod
    def zeros(cls, topology: Topology) -> "Traffic":
        w = topology.world_size
        return cls(torch.zeros(w, w, dtype=torch.long), topology)


def destination_ranks(expert_idx: Tensor, placement: Placement) -> Tensor:
    """[T, K] rank of each selected expert; -1 for dropped slots."""
    ranks = placement.rank_tensor(expert_idx.device)
    return torch.where(expert_idx >= 0, ranks[expert_idx.clamp_min(0)], -1)


def unique_pairs(a: Tensor, b: Tensor, n_b: int) -> tuple[Tensor, Tensor, Tensor]:
    """Distinct (a, b) combinations (b < n_b): their a, their b, and each input's combination index."""
    keys, inverse = torch.unique(a * n_b + b, return_inverse=True)
    return keys // n_b, keys % n_b, inverse


def distinct_targets(targets: Tensor, num_targets: int) -> tuple[Tensor, Tensor]:
    """Distinct (token, target) pairs of a [T, K] target table (-1 = none): O(T K), not O(T N)."""
    tok = torch.arange(targets.shape[0], device=targets.device).unsqueeze(1).expand_as(targets)
    valid = targets >= 0
    token, target, _ = unique_pairs(tok[valid], targets[valid], num_targets)
    return token, target


def dispatch_traffic(expert_idx, src_rank, placement: Placement, topology: Topology, token_bytes: int,
                     dedup: str = "rank") -> Traffic:
    if dedup not in DEDUP_MODES:
        raise ValueError(f"dedup must be one of {DEDUP_MODES}, got {dedup!r}")
    w = topology.world_size
    if placement.world_size != w:
        raise ValueError(f"placement has {placement.world_size} ranks, topology {w}")
    expert_idx = torch.as_tensor(expert_idx).long()
    if expert_idx.dim() != 2:
        raise ValueError(f"expert_idx must be [T, K], got shape {tuple(expert_idx.shape)}")
    if expert_idx.numel() and int(expert_idx.max()) >= placement.num_experts:
        raise ValueError(f"expert_idx holds ids >= num_experts={placement.num_experts}")
    t = expert_idx.shape[0]
    src = torch.as_tensor(src_rank, dtype=torch.long)
    if src.dim() == 0:
        src = src.expand(t)
    if src.shape != (t,):
        raise ValueError(f"src_rank must be an int or a [T] tensor, got shape {tuple(src.shape)}")
    matrix = torch.zeros(w, w, dtype=torch.long)
    dst = destination_ranks(expert_idx, placement)

    def add(rows: Tensor, cols: Tensor) -> None:
        keep = rows != cols
        flat = rows[keep] * w + cols[keep]
        matrix.view(-1).add_(torch.bincount(flat, minlength=w * w) * token_bytes)

    if dedup == "none":
        valid = dst >= 0
        add(src.unsqueeze(1).expand_as(dst)[valid], dst[valid])
    elif dedup == "rank":
        tok, rank = distinct_targets(dst, w)
        add(src[tok], rank)
    else:
        g = topology.ranks_per_node
        node = torch.where(dst >= 0, dst // g, -1)
        tok, dst_node = distinct_targets(node, topology.num_nodes)
        gateway = dst_node * g + src[tok] % g  # own node: the source itself (nothing crosses)
        add(src[tok], gateway)
        # inside each destination node, the gateway forwards one copy per distinct rank
        tok, rank = distinct_targets(dst, w)
        add(((rank // g) * g + src[tok] % g), rank)
    return Traffic(matrix, topology)
