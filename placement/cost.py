"""Latency-bandwidth (alpha-beta) cost of an all-to-all, per topology level.

Model: the traffic crossing level l moves over that level's links. Each link
carries the bytes of one rank, or with ``shared: true`` the bytes of every rank
of one unit just inside the level (one network card per node, say); a link
takes its larger direction over the bandwidth, every message costs alpha, and
the level is as slow as its slowest link,

    t_l = alpha_l * max_r peers_l(r) + max_link max(sent, received) / bandwidth_l.

A one-hop exchange (dedup none or rank) drives every level at once and takes
max_l t_l; node dedup's two hops (cross the node boundary, then forward
inside the node) run one after the other and take sum_l t_l.

A layer (``layer_seconds``) adds what the payload does not show: every collective
costs ``latency_s`` (the launch, the split-size read; calibrated with empty
all-to-alls), and a hop runs three small ones beside its four payload
exchanges (dispatch and combine, forward and backward): the split sizes and the
metadata forward, the gates' gradients backward. Blocking exchanges add to the
layer's compute; pipelined ones (C chunks) overlap it, ``overlap`` in [0, 1]
being the share of the shorter of the two that hides under the longer (measured
by ``dist-moe calibrate``: 1 where the link and compute use separate engines, less
where the exchange needs the same cores); node dedup's two hops overlap each
other the same way, chunks in flight together move at ``chunked`` times the time
of one exchange sent whole (calibrated: several in flight can fill a link one
leaves idle), and each chunk's exchanges pay their own latency.

Defaults (overridable per level in a topology YAML ``cost:`` block, or fitted
from a calibration exchange with ``fit_level``):

    innermost level (e.g. gpu: NVLink-class)   alpha 5 us,  bandwidth 150 GB/s
    the node level  (e.g. InfiniBand per GPU)  alpha 10 us, bandwidth 25 GB/s
    any level outside it (e.g. rack)           alpha 20 us, bandwidth 12.5 GB/s
    every level: shared false (a link per rank)
"""
from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, replace

import torch

_INNER = {"alpha_s": 5e-6, "bandwidth_Bps": 150e9}
_NODE = {"alpha_s": 10e-6, "bandwidth_Bps": 25e9}
_OUTER = {"alpha_s": 20e-6, "bandwidth_Bps": 12.5e9}

# The range (and unit) of each number of a link and an exchange. A link under 1 byte/s, a latency over a
# minute or a chunked ratio off by more than 100x is a typo or a failed measurement, and would price an
# exchange at an overflowing (inf) or meaningless number of seconds.
BOUNDS = {"alpha_s": (0.0, 60.0, " s"), "bandwidth_Bps": (1.0, 1e18, " bytes/s"), "latency_s": (0.0, 60.0, " s"),
          "overlap": (0.0, 1.0, ""), "chunked": (0.01, 100.0, "")}


def in_range(value, low: float, high: float, name: str, unit: str = "") -> float:
    """``value`` as a float when it is a number in [low, high] (NaN never is), else a ValueError naming
    it ``name`` and the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{name} must be a finite number in [{low:g}, {high:g}]{unit}, got {reprlib.repr(value)}")
    return float(value)


def in_bounds(key: str, value, name: str | None = None) -> float:
    """``in_range`` with ``BOUNDS[key]``, named ``name`` (default: ``key``)."""
    low, high, unit = BOUNDS[key]
    return in_range(value, low, high, name or key, unit)


@dataclass(frozen=True)
class LevelCost:
    alpha_s: float
    bandwidth_Bps: float
    shared: bool = False  # one link per unit inside the level instead of one per rank

    def __post_init__(self):
        in_bounds("alpha_s", self.alpha_s)
        in_bounds("bandwidth_Bps", self.bandwidth_Bps)

    def seconds(self, peers: float, link_bytes: float) -> float:
        """The alpha-beta time at this level: alpha per peer reached, the link's bytes over its bandwidth."""
        return self.alpha_s * peers + link_bytes / self.bandwidth_Bps


@dataclass(frozen=True)
class CostModel:
    levels: dict  # level name -> LevelCost
    latency_s: float = 0.0  # per collective, beyond the levels' per-peer alpha
    overlap: float = 0.0  # share of min(exchange, compute) a pipelined layer hides
    chunked: float = 1.0  # an exchange sent as concurrent chunks over the same sent whole

    @classmethod
    def default(cls, level_names) -> CostModel:
        names = list(level_names)
        node_pos = names.index("node") if "node" in names else len(names) - 2
        out: dict[str, LevelCost] = {}
        for i, name in enumerate(names):
            base: dict = _INNER if i == len(names) - 1 else (_NODE if i == node_pos else _OUTER)
            out[name] = LevelCost(**base)
        return cls(out)

    def updated(self, overrides: dict) -> CostModel:
        out = dict(self.levels)
        for name, values in overrides.items():
            if name not in out:
                raise ValueError(f"cost given for unknown level {name!r}; levels: {list(out)}")
            unknown = sorted(set(values) - {"alpha_s", "bandwidth_Bps", "shared"})
            if unknown:
                raise ValueError(f"unknown cost key {unknown[0]!r} for level {name!r}; "
                                 "valid: alpha_s, bandwidth_Bps, shared")
            base = out[name]
            shared = values.get("shared", base.shared)
            if not isinstance(shared, bool):  # bool("no") would be True
                raise ValueError(f"'cost.{name}.shared' must be true or false, got {reprlib.repr(shared)}")
            out[name] = LevelCost(in_bounds("alpha_s", values.get("alpha_s", base.alpha_s), f"'cost.{name}.alpha_s'"),
                                  in_bounds("bandwidth_Bps", values.get("bandwidth_Bps", base.bandwidth_Bps),
                                            f"'cost.{name}.bandwidth_Bps'"), shared)
        return replace(self, levels=out)

    def with_exchange(self, latency_s: float, overlap: float, chunked: float = 1.0) -> CostModel:
        given = {"latency_s": latency_s, "overlap": overlap, "chunked": chunked}
        bounded: dict = {key: in_bounds(key, value, f"'exchange.{key}'") for key, value in given.items()}
        return replace(self, **bounded)

    def check_levels(self, names) -> None:
        if list(self.levels) != list(names):
            raise ValueError(f"cost model levels {list(self.levels)} do not match topology levels {list(names)}")

    def link_load(self, i: int, topology, sent: torch.Tensor, recv: torch.Tensor) -> torch.Tensor:
        """Each link's load at level ``i`` from [W] amounts each rank sends and receives across it: its
        larger direction, a link per rank, or per unit just inside the level when the level is shared."""
        if self.levels[topology.levels[i]].shared:  # the unit's ranks share one link
            unit = math.prod(topology.sizes[i + 1 :])
            sent, recv = sent.reshape(-1, unit).sum(1), recv.reshape(-1, unit).sum(1)
        return torch.maximum(sent.double(), recv.double())

    def phase_times(self, matrix: torch.Tensor, topology) -> dict:
        """Seconds per level for a [W, W] byte matrix on ``topology``: the busiest link and the most peers."""
        out = {}
        m = matrix.double()
        level_of = topology.level_matrix()
        for i, (name, c) in enumerate(self.levels.items()):
            mask = level_of == i
            crossing = m * mask
            if not crossing.numel():
                out[name] = 0.0
                continue
            peers = float(((m > 0) & mask).sum(1).max())
            out[name] = c.seconds(peers, float(self.link_load(i, topology, crossing.sum(1), crossing.sum(0)).max()))
        return out

    def estimate(self, traffic, dedup: str = "rank") -> float:
        """Estimated all-to-all seconds for a ``placement.Traffic`` sent with ``dedup``."""
        return sum(self.hop_seconds(traffic, dedup))

    def layer_seconds(self, traffic, dedup: str, compute_s: float, chunks: int = 1) -> dict:
        """Predicted forward + backward seconds of one MoE layer whose dispatch sends ``traffic``
        and whose own work (router, experts, gathers; no exchange) takes ``compute_s``."""
        return self.layer_time(self.hop_seconds(traffic, dedup), compute_s, chunks)

    def hop_seconds(self, traffic, dedup: str) -> list:
        """Seconds of each hop of the exchange: node dedup's one per level, else one (all levels at once)."""
        phases = list(self.phase_times(traffic.matrix, traffic.topology).values())
        return phases if traffic.topology.effective_dedup(dedup) == "node" else [max(phases, default=0.0)]

    def _hidden(self, times: list, chunks: int) -> float:
        """Pipelined, the longest of ``times`` hides the others but for what does not overlap and
        one chunk's fill."""
        long = max(times, default=0.0)
        return long + (sum(times) - long) * (1 - self.overlap + self.overlap / chunks)

    def layer_time(self, hop_s: list, compute_s: float, chunks: int = 1) -> dict:
        """``layer_seconds`` from the seconds of each hop of one dispatch exchange (node dedup's
        two hops: one after the other, or pipelined against each other chunk by chunk)."""
        n = len(hop_s)
        plan = 3 * n * self.latency_s
        if chunks == 1:
            payload = 4 * sum(hop_s) + 4 * n * self.latency_s
            return {"exchange_s": plan + payload, "compute_s": compute_s, "layer_s": plan + payload + compute_s}
        payload = 4 * self._hidden(hop_s, chunks) * self.chunked + 4 * n * chunks * self.latency_s
        total = plan + self._hidden([payload, compute_s], chunks)
        return {"exchange_s": plan + payload, "compute_s": compute_s, "layer_s": total}


def fit_level(peers, nbytes, seconds, shared: bool = False) -> LevelCost:
    """Least-squares alpha and 1/bandwidth from calibration samples (seconds ~ alpha*peers + bytes*beta).

    ``nbytes`` are per link: per rank, or per unit when ``shared``.
    """
    a = torch.tensor([[float(p), float(b)] for p, b in zip(peers, nbytes)], dtype=torch.float64)
    y = torch.tensor([float(s) for s in seconds], dtype=torch.float64).unsqueeze(1)
    sol = torch.linalg.lstsq(a, y).solution.flatten()
    alpha, beta = max(float(sol[0]), 0.0), float(sol[1])
    if beta <= 0:
        raise ValueError("calibration did not show time growing with bytes; use larger messages")
    return LevelCost(alpha, 1.0 / beta, shared)
