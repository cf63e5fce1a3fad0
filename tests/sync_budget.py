"""Count the operations that block the host on a GPU, on any device.

On CUDA these wait for the device: reading a value back (``.item()``, ``int()``, ``bool()``,
``.tolist()``) and the ops whose output size depends on the data (``nonzero``, ``unique``,
``bincount``, ``masked_select``, boolean-mask indexing, ``repeat_interleave`` without
``output_size``). A ``TorchDispatchMode`` sees every aten op a forward or backward runs, also
on the CPU, so the count is the same one a GPU run would pay; ``tolist`` reads CPU memory
without an aten op and is counted by a wrapper.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_DATA_DEPENDENT = {"aten._local_scalar_dense", "aten.nonzero", "aten._unique2", "aten.unique_dim",
                   "aten.unique_consecutive", "aten.bincount", "aten.masked_select", "aten.argwhere"}


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


class HostSyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in _DATA_DEPENDENT:
            self.counts[name] += 1
        elif name == "aten.repeat_interleave" and isinstance(args[0], torch.Tensor) and args[0].dim() > 0 \
                and kwargs.get("output_size") is None and (len(args) < 2 or not isinstance(args[1], int)):
            self.counts["repeat_interleave without output_size"] += 1
        elif name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
                _is_mask(i) for i in (args[1] if len(args) > 1 else [])):
            self.counts["boolean-mask indexing"] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextlib.contextmanager
def counting():
    """``with counting() as c: ...``; ``c.total`` and ``c.counts`` afterwards (tolist included)."""
    counter = HostSyncCounter()
    original = torch.Tensor.tolist

    def tolist(self):
        counter.counts["tolist"] += 1
        return original(self)

    torch.Tensor.tolist = tolist
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = original
