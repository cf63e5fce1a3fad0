"""Named stages of an MoE layer's forward and backward, for profilers.

Every stage is a ``torch.profiler.record_function`` range named ``dist_moe.<stage>``, so
torch.profiler (and what reads its traces) shows route, plan, each exchange's wait, experts
and combine by name, as Megatron-core's named stages do. On the CPU, where host time is the
time, ``StageClock`` also totals each stage's seconds for a benchmark's per-stage profile; on a
GPU read the profiler's device times instead (host times there only count launches).
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

from torch.profiler import record_function

_CLOCKS: list = []  # the StageClocks now running (normally none)


@contextlib.contextmanager
def stage(name: str):
    """One stage's range (and, while a ``StageClock`` runs, its host seconds)."""
    with record_function("dist_moe." + name):
        if not _CLOCKS:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            for clock in _CLOCKS:
                clock.seconds[name] += time.perf_counter() - start


class StageClock(contextlib.AbstractContextManager):
    """Host seconds per stage while entered: ``with StageClock() as clock: ...; clock.seconds``."""

    def __init__(self):
        self.seconds: dict = defaultdict(float)

    def __enter__(self):
        _CLOCKS.append(self)
        return self

    def __exit__(self, *exc):
        _CLOCKS.remove(self)
        return None
