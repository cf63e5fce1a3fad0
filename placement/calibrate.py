"""Fit the cost model to this launch's links with the exchanges a dispatch makes (``dist-moe calibrate``).

Per topology level, a sweep of all-to-alls in which every rank sends the same bytes to every
peer across that level, and to nobody else (the pattern of a uniform dispatch at that level),
fits alpha per peer and the bandwidth (``placement.cost.fit_level``). Whether a level's link is
shared by the ranks of a unit (one network card per node, a veth per emulated node) is read off
the same exchange run with one sender per unit: a private link takes as long, a shared one
about a unit's ranks times less. One-byte all-to-alls give the latency every collective pays;
one exchange run while this rank multiplies matrices gives the share of the shorter of the two
that overlap hides; the same exchange cut into concurrent chunks, how fast chunks in flight
together move. Times are medians over repeats of the slowest rank; the latency's over 8 times as many, with the
middle half of them beside it (``calibration``).
"""
from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from placement import CostModel, Topology, fit_level

SIZES = (1 << 18, 1 << 20, 1 << 21)  # bytes per peer: past a shaper's burst, short enough to sweep
# The one-byte exchange is repeated this many times more than the others: it is the cheapest (a few ms in all) and
# the noisiest, a descheduled rank or a shaper's burst taking it from 0.3 to 5 ms on a busy machine, where a median
# of 5 can land on either
LATENCY_REPEATS = 8


@dataclass(frozen=True)
class Spread:
    """A time's median over its repeats and the middle half of them (first to third quartile), in seconds."""
    median: float
    low: float
    high: float
    repeats: int

    @classmethod
    def of(cls, times: list[float]) -> Spread:
        low, _, high = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else times * 3
        return cls(statistics.median(times), low, high, len(times))


@dataclass(frozen=True)
class Calibration:
    """What ``dist-moe calibrate`` fitted, and how noisy its latency was."""
    cost: CostModel
    latency: Spread  # the one-byte exchange's, whose median is cost.latency_s


def slowest(fn, repeats: int = 5, group=None) -> float:
    """Median over repeats of the slowest rank's seconds for fn() (one warm-up run first)."""
    return slowest_spread(fn, repeats, group).median


def slowest_spread(fn, repeats: int = 5, group=None) -> Spread:
    """The slowest rank's seconds for fn() over repeats (one warm-up run first)."""
    times = [slowest_once(fn, group) for _ in range(repeats + 1)]
    return Spread.of(times[1:])


def slowest_once(fn, group=None) -> float:
    """The slowest rank's seconds for one fn(), every rank of ``group`` starting together."""
    dist.barrier(group=group)
    start = time.perf_counter()
    fn()
    if _device().type == "cuda":
        torch.cuda.synchronize()
    t = torch.tensor([time.perf_counter() - start], device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _device() -> torch.device:
    """Where the group's collectives run: this process's GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def replay(matrix: torch.Tensor, mask: torch.Tensor | None = None, async_op: bool = False):
    """One all_to_all_single carrying exactly the bytes of ``matrix`` [W, W] (where ``mask``)."""
    r, device = dist.get_rank(), _device()
    m = matrix if mask is None else matrix * mask
    send, recv = m[r].tolist(), m[:, r].tolist()
    out = torch.empty(sum(recv), dtype=torch.uint8, device=device)
    data = torch.zeros(sum(send), dtype=torch.uint8, device=device)
    return dist.all_to_all_single(out, data, recv, send, async_op=async_op)


def replay_dispatch(matrix: torch.Tensor, topology: Topology, dedup: str) -> None:
    """A dispatch's bytes as it sends them: node dedup crosses the node boundary, then forwards inside
    the nodes (two exchanges); the other modes drive every level in one."""
    if dedup != "node":
        return replay(matrix)
    cross = topology.level_matrix() == 0
    replay(matrix, cross)
    replay(matrix, ~cross)


def level_pattern(topology: Topology, level: int, nbytes: int, one_sender_per_unit: bool = False) -> torch.Tensor:
    """[W, W] bytes: each rank to every peer whose first differing coordinate is ``level``."""
    w = topology.world_size
    ranks = torch.arange(w)
    m = torch.where(topology.crossing_levels(ranks.unsqueeze(1).expand(w, w), ranks.expand(w, w)) == level,
                    nbytes, 0).long()
    if one_sender_per_unit:  # only the first rank of each unit just inside the level sends
        unit = math.prod(topology.sizes[level + 1:])
        m[ranks % unit != 0] = 0
    return m


def calibrate(topology: Topology, sizes=SIZES, repeats: int = 5) -> CostModel:
    """The launch's cost model: per-level alpha, bandwidth and sharing, collective latency, overlap."""
    return calibration(topology, sizes, repeats).cost


def calibration(topology: Topology, sizes=SIZES, repeats: int = 5) -> Calibration:
    """The launch's cost model, and the spread of the collective latency it holds."""
    w = topology.world_size
    spread = slowest_spread(lambda: replay(torch.ones(w, w, dtype=torch.long)),  # one byte to every peer
                            LATENCY_REPEATS * repeats)
    cost = _fit_levels(topology, sizes, repeats, spread.median)
    return Calibration(cost.with_exchange(spread.median, *measure_overlap(topology, repeats)), spread)


def _fit_levels(topology: Topology, sizes, repeats: int, latency: float) -> CostModel:
    """Per level: alpha, bandwidth and whether its link is shared, from the sweep in its own pattern."""
    defaults = CostModel.default(topology.levels)
    fitted = {}
    for li, name in enumerate(topology.levels):
        if topology.sizes[li] == 1:  # nothing crosses this level
            fitted[name] = defaults.levels[name]
            continue
        unit = math.prod(topology.sizes[li + 1:])
        peers = (topology.sizes[li] - 1) * unit
        times = [slowest(functools.partial(replay, level_pattern(topology, li, s)), repeats) for s in sizes]
        # private links take as long with one sender per unit; a shared one ~unit x less
        alone = [slowest(functools.partial(replay, level_pattern(topology, li, sizes[-1], True)), repeats)] \
            if unit > 1 else []
        # the fixed cost to take off: the one-byte exchange's, but it crosses every level, so a level inside a
        # node can run faster than it; what this level's own smallest exchange took bounds it
        base = min(latency, *times, *alone)
        shared = bool(alone) and (times[-1] - base) > (1 + unit) / 2 * max(alone[0] - base, 1e-9)
        per_link = [s * peers * (unit if shared else 1) for s in sizes]
        try:
            fitted[name] = fit_level([peers] * len(sizes), per_link, [t - base for t in times], shared)
        except ValueError:
            ms = ", ".join(f"{1e3 * t:.2f}" for t in times)
            raise ValueError(f"calibration: the {name} level's exchanges did not take longer with more bytes ({ms} ms "
                             f"for {', '.join(_size(s) for s in sizes)} per peer); the link was busy or its bandwidth "
                             "is beyond these sizes: run it again, with more --repeats") from None
    return CostModel(fitted)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _matmuls(a: torch.Tensor, seconds: float) -> int:
    """How many ``a @ a`` take about ``seconds`` here."""
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.05:
        a @ a
        n += 1
    if a.is_cuda:
        torch.cuda.synchronize()
    return max(1, int(n * seconds / (time.perf_counter() - start)))


def measure_overlap(topology: Topology, repeats: int = 5, chunks: int = 4) -> tuple[float, float]:
    """(share of min(exchange, compute) hidden when an async exchange runs beside compute, time of
    the exchange sent as ``chunks`` concurrent all-to-alls over its time sent whole)."""
    outer = next(i for i, s in enumerate(topology.sizes) if s > 1)  # the slowest level that is crossed
    pattern = level_pattern(topology, outer, SIZES[-1])
    exchange = slowest(lambda: replay(pattern), repeats)
    piece = level_pattern(topology, outer, SIZES[-1] // chunks)

    def in_chunks():
        for work in [replay(piece, async_op=True) for _ in range(chunks)]:
            work.wait()

    chunked = slowest(in_chunks, repeats) / exchange
    a = torch.randn(256, 256, device=_device())
    count = torch.tensor([_matmuls(a, exchange)], device=_device())
    dist.all_reduce(count, op=dist.ReduceOp.MIN)  # every rank computes as long

    def compute():
        for _ in range(int(count)):
            a @ a

    alone = slowest(compute, repeats)

    def both():
        work = replay(pattern, async_op=True)
        compute()
        work.wait()

    together = slowest(both, repeats)
    hidden = (exchange + alone - together) / max(min(exchange, alone), 1e-9)
    return min(max(hidden, 0.0), 1.0), chunked


def to_yaml(topology: Topology, cost: CostModel) -> dict:
    """The topology YAML ``Topology.from_yaml`` reads back (``dist-moe plan --topology FILE`` etc.)."""
    return {"levels": list(topology.levels), "sizes": list(topology.sizes),
            "cost": {n: {"alpha_s": c.alpha_s, "bandwidth_Bps": c.bandwidth_Bps, "shared": c.shared}
                     for n, c in cost.levels.items()},
            "exchange": {"latency_s": cost.latency_s, "overlap": cost.overlap, "chunked": cost.chunked,
                         "calibrated": time.strftime("%Y-%m-%d %H:%M")}}
