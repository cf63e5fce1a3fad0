"""Record, per rank, every collective issued and every wait on one, with its process group.

``recording()`` wraps the torch.distributed calls dist-moe makes (all-to-all, all-reduce, all-gather,
broadcast, barrier); an async call's work is wrapped so its ``wait`` is logged too. Each event is
(kind, op, group name): torch names groups by a counter every rank advances alike, so two ranks' logs of
the same program compare entry by entry."""
from __future__ import annotations

import contextlib

import torch.distributed as dist

OPS = ("all_to_all_single", "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier",
       "reduce_scatter_tensor")


def group_name(group) -> str:
    return dist._get_process_group_name(group if group is not None else dist.group.WORLD)


class _Work:
    def __init__(self, work, event, log):
        self._work, self._event, self._log = work, event, log

    def wait(self, *args, **kwargs):
        self._log.append(("wait", *self._event[1:]))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def recording():
    """Yields the log: a list of (``issue`` or ``wait``, op, group name, issue index)."""
    log: list[tuple] = []
    originals = {op: getattr(dist, op) for op in OPS}

    def wrap(op, fn):
        def recorded(*args, **kwargs):
            event = ("issue", op, group_name(kwargs.get("group")), sum(e[0] == "issue" for e in log))
            log.append(event)
            work = fn(*args, **kwargs)
            return _Work(work, event, log) if kwargs.get("async_op") and work is not None else work
        return recorded

    for op, fn in originals.items():
        setattr(dist, op, wrap(op, fn))
    try:
        yield log
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)
