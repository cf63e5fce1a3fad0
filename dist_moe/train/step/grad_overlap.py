"""Replicated gradients summed over the data-parallel ranks while backward still runs.

What DDP's reducer does, for the parameters every rank holds (a rank's experts stay apart: their
gradients already hold every rank's tokens). Parameters go into buckets of about 25 MiB in reverse
order (the order backward reaches them); a post-accumulate-grad hook counts each bucket's gradients
and starts its all-reduce, asynchronously, once all have arrived, always in bucket order so every
rank issues the same collectives in the same order. ``finish`` (after backward) starts any bucket a
gradient never reached (zeros), waits, and writes the sums back. The sums run on a process group of
their own, and start only once every exchange of the step has run its backward, in one order on every
rank (``distributed/collective_order.py``): a sum started between two exchanges on one rank and after
them on another would deadlock NCCL with one connection. A second ``OverlappedGradSum`` chained
``after`` a first starts its buckets once the first has started all of its own.
DDP itself would hold its group strongly past ``destroy_process_group`` (``groups.py`` says why
dist-moe never does) and would need every forward to pass through its wrapper.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dist_moe.distributed.collective_order import exchanges_pending
from dist_moe.distributed.groups import WeakGroup
from dist_moe.train.step.grads import BUCKET_BYTES


def _buckets(params: list, bucket_bytes: int) -> list[list]:
    """Consecutive runs of ``params`` of one dtype and device, each about ``bucket_bytes``."""
    buckets: list[list] = []
    size = 0
    for p in params:
        if not buckets or size >= bucket_bytes or (p.dtype, p.device) != (buckets[-1][0].dtype, buckets[-1][0].device):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return buckets


class OverlappedGradSum:
    """Sums the gradients of ``params`` over ``group`` during the backward between ``arm`` and ``finish``."""

    group = WeakGroup()  # held weakly (groups.py)

    def __init__(self, params: list, make_group, bucket_bytes: int = BUCKET_BYTES, after=None):
        self.make_group, self._made = make_group, False  # made at the first arm: GAR's runs never arm
        self.after: OverlappedGradSum | None = after  # starts nothing until that one has started everything
        self.then: OverlappedGradSum | None = None
        if after is not None:
            after.then = self
        self.buckets = _buckets(list(reversed(params)), bucket_bytes)
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.armed = False
        for p in params:  # hooks live as long as the parameters; unarmed they do nothing (GAR's backwards)
            p.register_post_accumulate_grad_hook(self._arrived)

    def arm(self) -> None:
        """The next backward's gradients are summed as they arrive (every rank arms at the same step)."""
        if not self._made:
            self.group, self._made = self.make_group(), True
        self.armed, self.next = True, 0
        self.works: list = []
        self.sizes: list[tuple[int, int]] = []  # (elements, element size) of each sum this step started
        self.waiting = [len(bucket) for bucket in self.buckets]

    def _arrived(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        self.waiting[self.bucket_of[id(p)]] -= 1
        self._start_ready()

    def _start_ready(self) -> None:
        """Start the ready buckets, in order, unless an exchange's backward is still to come or the sum
        this one follows has buckets left to start."""
        if exchanges_pending() or (self.after is not None and self.after.next < len(self.after.buckets)):
            return
        while self.next < len(self.buckets) and self.waiting[self.next] == 0:
            self._start(self.next)
        if self.next == len(self.buckets) and self.then is not None and self.then.armed:
            self.then._start_ready()

    def _start(self, i: int) -> None:
        bucket = self.buckets[i]
        for p in bucket:
            if p.grad is None:  # unused in this step: every rank still reduces every parameter
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        self.works.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, bucket))
        self.sizes.append((flat.numel(), flat.element_size()))
        self.next = i + 1

    def finish(self) -> None:
        """After backward: every bucket reduced and its sums in ``.grad``."""
        while self.next < len(self.buckets):
            self._start(self.next)
        for work, flat, bucket in self.works:
            work.wait()
            for p, part in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad.copy_(part.view_as(p.grad))
        self.armed, self.works = False, []


def overlapped_grad_sum(params: list, group, timeout=None) -> OverlappedGradSum:
    """An ``OverlappedGradSum`` on a new group of ``group``'s ranks, made when it first arms (a
    collective of the whole world: every rank arms at its first step)."""
    ranks = dist.get_process_group_ranks(group)
    return OverlappedGradSum(params, lambda: dist.new_group(ranks, timeout=timeout))
