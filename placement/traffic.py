"""Exact byte accounting of expert-parallel dispatch (the byte rules below).

Payload only: ``token_bytes = wire_row_bytes(hidden_size, wire dtype)``; routing metadata is
counted separately by the dispatcher and never mixed in. The counting runs on the
dispatcher's own plan (``placement.plan``), so the rules below are written once. Bytes that stay on
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
from placement.plan import DEDUP_MODES, DispatchPlan
from placement.topology import Topology

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
FP8_GROUP = 128  # values of a row per fp32 scale on an fp8 wire


def wire_row_bytes(hidden: int, dtype: str) -> int:
    """Bytes one token copy of ``hidden`` values takes on a wire of ``dtype``: fp8's e4m3 values carry one
    fp32 scale per 128 of them (a shorter last group where 128 does not divide ``hidden``)."""
    return hidden + 4 * -(-hidden // FP8_GROUP) if dtype == "fp8" else hidden * DTYPE_BYTES[dtype]

__all__ = ["DEDUP_MODES", "Traffic", "dispatch_traffic"]


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
    def zeros(cls, topology: Topology) -> Traffic:
        w = topology.world_size
        return cls(torch.zeros(w, w, dtype=torch.long), topology)


def dispatch_traffic(expert_idx, src_rank, placement: Placement, topology: Topology, token_bytes: int,
                     dedup: str = "rank") -> Traffic:
    """The bytes the dispatcher sends for these routings, from the same ``DispatchPlan`` it executes."""
    expert_idx = torch.as_tensor(expert_idx).long()
    if expert_idx.dim() == 2 and expert_idx.numel() and int(expert_idx.max()) >= placement.num_experts:
        raise ValueError(f"expert_idx holds ids >= num_experts={placement.num_experts}")
    plan = DispatchPlan.build(expert_idx, placement, topology, dedup, src_rank)
    return Traffic(plan.traffic_matrix(token_bytes), topology)
