"""The inter-node link's lower bound on a layer's time: its node-crossing bytes at the line rate.

Under ``launch/emulate_cluster.sh`` the link between the emulated nodes is shaped to a known rate
(``--rate``, exported as ``DIST_MOE_EMULATED_RATE``) in each direction; a layer's forward and
backward move its dispatch bytes four times (dispatch and combine, each way), each node's
outgoing and incoming bytes on its own link. No schedule moves them faster.
"""
from __future__ import annotations

import os
import re

import torch

from placement import Topology

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def line_rate() -> float | None:
    """Bytes per second of the emulated inter-node link (tc's rate units), or None when not emulated."""
    spec = os.environ.get("DIST_MOE_EMULATED_RATE", "")
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([kmgt]i?)?(bit|bps)", spec)
    if not m:
        return None
    value = float(m.group(1)) * _UNITS[m.group(2) or ""]
    return value / 8 if m.group(3) == "bit" else value  # tc: bps is bytes per second


def line_seconds(matrix: torch.Tensor, topology: Topology, rate: float) -> float:
    """4 x the busiest node's larger direction of node-crossing bytes in ``matrix`` [W, W], at ``rate``."""
    node = torch.tensor([topology.node_of(r) for r in range(topology.world_size)])
    n = topology.num_nodes
    per_node = torch.zeros(n, n, dtype=torch.float64).index_put_(
        (node.repeat_interleave(len(node)), node.repeat(len(node))), matrix.double().flatten(), accumulate=True)
    crossing = per_node - torch.diag(per_node.diagonal())
    return 4 * float(torch.maximum(crossing.sum(1), crossing.sum(0)).max()) / rate
