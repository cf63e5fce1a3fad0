"""Latency-bandwidth (alpha-beta) cost of an all-to-all, per topology level.

Model: each level is a phase. In the phase of level l, rank r exchanges with its
peers across l; the phase lasts as long as its slowest rank,

    t_l = max_r ( alpha_l * peers_l(r) + max(sent_l(r), received_l(r)) / bandwidth_l )

and the all-to-all takes sum_l t_l. Phases in sequence match node dedup (cross
the node boundary, then forward inside the node) and are conservative for the
one-stage modes, where both levels overlap.

Defaults (overridable per level in a topology YAML ``cost:`` block, or fitted
from a calibration exchange with ``fit_level``):

    innermost level (e.g. gpu: NVLink-class)   alpha 5 us,  bandwidth 150 GB/s
    the node level  (e.g. InfiniBand per GPU)  alpha 10 us, bandwidth 25 GB/s
    any level outside it (e.g. rack)           alpha 20 us, bandwidth 12.5 GB/s
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_INNER = {"alpha_s": 5e-6, "bandwidth_Bps": 150e9}
_NODE = {"alpha_s": 10e-6, "bandwidth_Bps": 25e9}
_OUTER = {"alpha_s": 20e-6, "bandwidth_Bps": 12.5e9}


@dataclass(frozen=True)
class LevelCost:
    alpha_s: float
    bandwidth_Bps: float

    def __post_init__(self):
        if not (self.alpha_s >= 0 and self.bandwidth_Bps > 0):
            raise ValueError(f"level cost needs alpha_s >= 0 and bandwidth_Bps > 0, got {self}")


@dataclass(frozen=True)
class CostModel:
    levels: dict  # level name -> LevelCost

    @classmethod
    def default(cls, level_names) -> "CostModel":
        names = list(level_names)
        node_pos = names.index("node") if "node" in names else len(names) - 2
        out = {}
        for i, name in enumerate(names):
            base = _INNER if i == len(names) - 1 else (_NODE if i == node_pos else _OUTER)
            out[name] = LevelCost(**base)
        return cls(out)

    def updated(self, overrides: dict) -> "CostModel":
        out = dict(self.levels)
        for name, values in overrides.items():
            if name not in out:
                raise ValueError(f"cost given for unknown level {name!r}; levels: {list(out)}")
            unknown = sorted(set(values) - {"alpha_s", "bandwidth_Bps"})
            if unknown:
                raise ValueError(f"unknown cost key {unknown[0]!r} for level {name!r}; valid: alpha_s, bandwidth_Bps")
            base = out[name]
            out[name] = LevelCost(float(values.get("alpha_s", base.alpha_s)),
                                  float(values.get("bandwidth_Bps", base.bandwidth_Bps)))
        return CostModel(out)

    def check_levels(self, names) -> None:
        if list(self.levels) != list(names):
            raise ValueError(f"cost model levels {list(self.levels)} do not match topology levels {list(names)}")

    def phase_times(self, matrix: torch.Tensor, level_of: torch.Tensor) -> dict:
        """Seconds per level for a [W, W] byte matrix, given crossing-level indices [W, W]."""
        out = {}
        m = matrix.double()
        for i, (name, c) in enumerate(self.levels.items()):
            mask = level_of == i
            sent = (m * mask).sum(1)
            recv = (m * mask).sum(0)
            peers = ((m > 0) & mask).sum(1).double()
            per_rank = c.alpha_s * peers + torch.maximum(sent, recv) / c.bandwidth_Bps
            out[name] = float(per_rank.max()) if per_rank.numel() else 0.0
        return out

    def estimate(self, traffic) -> float:
        """Estimated all-to-all seconds for a ``placement.Traffic``."""
        return sum(self.phase_times(traffic.matrix, traffic.topology.level_matrix()).values())


def fit_level(peers, nbytes, seconds) -> LevelCost:
    """Least-squares alpha and 1/bandwidth from calibration samples (seconds ~ alpha*peers + bytes*beta)."""
    a = torch.tensor([[float(p), float(b)] for p, b in zip(peers, nbytes)], dtype=torch.float64)
    y = torch.tensor([float(s) for s in seconds], dtype=torch.float64).unsqueeze(1)
    sol = torch.linalg.lstsq(a, y).solution.flatten()
    alpha, beta = max(float(sol[0]), 0.0), float(sol[1])
    if beta <= 0:
        raise ValueError("calibration did not show time growing with bytes; use larger messages")
    return LevelCost(alpha, 1.0 / beta)
