"""``parallel.pipeline_chunks: auto``: the chunk count a run measures for itself.

Pipelining pays where an exchange takes long next to the experts' work (a slow link between
nodes) and costs where it does not: every chunk is more collectives, more metadata and smaller
expert calls. How much it pays depends on the links, the model and the batch, which the cost
model predicts only roughly (``benchmarks/dispatch_time.py`` prints its error beside each
layer), so the run measures. With a node boundary to cross, its first training steps try each
candidate in turn (``STEPS_EACH`` steps, the first untimed), every step's time taken as the
slowest rank's, and the run keeps the fastest, preferring fewer chunks within ``TOLERANCE``
(fewer collectives for the same time). Without one (one node, or one rank) nothing slow can
hide behind the experts: one chunk, nothing measured. The tried steps are ordinary training
steps: the chunk count changes how the tokens travel, not what is computed (outputs equal one
chunk's up to the order of fp32 sums), so a deterministic run names a number instead.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from dist_moe.distributed.reductions import all_reduce_max

CANDIDATES = (1, 2, 4)
STEPS_EACH = 3  # the first step of a candidate is not timed: its exchanges' buffers change size
TOLERANCE = 0.03


def set_chunks(model: nn.Module, chunks: int) -> int:
    """Set every dist-moe-dispatched MoE layer's chunk count; how many layers took it."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "pipeline_chunks", None), int)]
    for m in layers:
        m.pipeline_chunks = chunks
    return len(layers)


def fastest(times: dict) -> int:
    """The fewest chunks within ``TOLERANCE`` of the fastest candidate's median step."""
    best = min(times.values())
    return min(c for c, t in times.items() if t <= best * (1 + TOLERANCE))


class ChunkTuner:
    """Drives the candidates over the first training steps (``before_step`` / ``after_step`` around
    each); ``chosen`` once measured (at once without a node boundary)."""

    def __init__(self, model: nn.Module, needed: bool, device: torch.device, group):
        self.model, self.device, self.group = model, device, group
        # (chunks, timed) per step still to try
        self.plan = [(c, i > 0) for c in CANDIDATES for i in range(STEPS_EACH)] if needed else []
        self.times: dict = {c: [] for c in CANDIDATES}
        self.medians: dict = {}
        self.chosen: int | None = None if self.plan else 1
        self.said = False  # the trainer printed the summary
        self._start = 0.0
        set_chunks(model, self.plan[0][0] if self.plan else 1)

    @property
    def tuning(self) -> bool:
        return bool(self.plan)

    def before_step(self) -> None:
        if self.plan:
            set_chunks(self.model, self.plan[0][0])
            self._settle()
            self._start = time.perf_counter()

    def after_step(self) -> None:
        """Time the step just run (the slowest rank's); after the last candidate, keep the fastest."""
        if not self.plan:
            return
        self._settle()
        chunks, timed = self.plan.pop(0)
        micros = all_reduce_max(int(1e6 * (time.perf_counter() - self._start)), self.group)  # every rank agrees
        if timed:
            self.times[chunks].append(micros / 1e6)
        if not self.plan:
            self.medians = {c: sorted(t)[len(t) // 2] for c, t in self.times.items()}
            self.chosen = fastest(self.medians)
            set_chunks(self.model, self.chosen)

    def summary(self) -> str:
        tried = ", ".join(f"C={c} {1e3 * t:.0f} ms" for c, t in self.medians.items())
        return f"parallel.pipeline_chunks auto: {tried} per step -> {self.chosen}"

    def _settle(self) -> None:
        if self.device.type == "cuda":  # step times need the queued work done: a few steps, once per run
            torch.cuda.synchronize(self.device)
