"""Profiler ranges around an MoE layer's stages and waits, forward and backward.

Every range is a ``torch.profiler.record_function`` named ``dist_moe.<name>``, so torch.profiler
(and what reads its traces) shows route, plan, each exchange's wait, experts and combine by name,
as Megatron-core's named stages do. On the CPU, where host time is the time, ``ProfileClock`` also
totals each range's seconds for a benchmark's per-stage profile; on a GPU read the profiler's
device times instead (host times there only count launches).
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

from torch.profiler import record_function

_CLOCKS: list = []  # the ProfileClocks now running (normally none)


@contextlib.contextmanager
def profiled(name: str):
    """One named range (and, while a ``ProfileClock`` runs, its host seconds)."""
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


class ProfileClock(contextlib.AbstractContextManager):
    """Host seconds per range while entered: ``with ProfileClock() as clock: ...; clock.seconds``."""

    def __init__(self):
        self.seconds: dict = defaultdict(float)

    def __enter__(self):
        _CLOCKS.append(self)
        return self

    def __exit__(self, *exc):
        _CLOCKS.remove(self)
        return None
