"""Count the operations that block the host on a GPU, on any device.

Two kinds, both a stall of the CUDA stream:

* **reads**: a value comes back to the host (``.item()``, ``int()``, ``bool()``, ``.tolist()``)
  or an op's output size depends on the data (``nonzero``, ``unique``, ``bincount``,
  ``masked_select``, boolean-mask indexing, ``repeat_interleave`` without ``output_size``);
* **builds**: a tensor made from Python data (``torch.tensor(list)``, ``as_tensor(int)``,
  ``new_tensor``, ``t[i] = 5``), which torch lifts with ``aten.lift_fresh``. On CUDA its bytes
  then go host -> device in a pageable, blocking copy that waits for every queued kernel.

A ``TorchDispatchMode`` sees every aten op a forward or backward runs, also on the CPU, so the
count is the one a GPU run would pay; ``tolist`` reads CPU memory without an aten op and is
counted by a wrapper. Each count keeps where it came from (the innermost frame in this project's
code), so a failure says which line to fix, and ``allowed`` names (file, function) pairs whose
builds are known to stay on the host (see the test's allow-list).
"""
from __future__ import annotations

import contextlib
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_DATA_DEPENDENT = {"aten._local_scalar_dense", "aten.nonzero", "aten._unique2", "aten.unique_dim",
                   "aten.unique_consecutive", "aten.bincount", "aten.masked_select", "aten.argwhere"}
_BUILDS = {"aten.lift_fresh", "aten.lift_fresh_copy"}
_ROOT = Path(__file__).resolve().parents[2]
_OURS = tuple(str(_ROOT / d) for d in ("dist_moe", "placement"))


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _where() -> tuple[str, str, int]:
    """(file relative to the repository, function, line) of the innermost frame in dist_moe/placement."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_OURS):
            return str(Path(name).relative_to(_ROOT)), frame.f_code.co_name, frame.f_lineno
        frame = frame.f_back
    return "?", "?", 0


class HostSyncCounter(TorchDispatchMode):
    def __init__(self, allowed: frozenset = frozenset(), host_only: frozenset = frozenset()):
        super().__init__()
        self.counts: Counter = Counter()  # what -> how many
        self.sites: Counter = Counter()  # (what, file, function, line) -> how many
        self.allowed_builds = 0  # builds at an allowed (file, function): host-only bookkeeping
        self.host_only = 0  # reads and builds in host_only code: math on host copies
        self._allowed, self._host_only = allowed, host_only

    def note(self, what: str, where=None) -> None:
        where = where or _where()
        if what == "build" and where[:2] in self._allowed:
            self.allowed_builds += 1
            return
        if where[:2] in self._host_only or where[0] in self._host_only or where[0].startswith(
                tuple(h for h in self._host_only if isinstance(h, str) and h.endswith("/"))):
            self.host_only += 1
            return
        self.counts[what] += 1
        self.sites[(what, *where)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in _BUILDS:
            self.note("build")
        elif name in _DATA_DEPENDENT:
            self.note(name)
        elif name == "aten.repeat_interleave" and isinstance(args[0], torch.Tensor) and args[0].dim() > 0 \
                and kwargs.get("output_size") is None and (len(args) < 2 or not isinstance(args[1], int)):
            self.note("repeat_interleave without output_size")
        elif name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
                _is_mask(i) for i in (args[1] if len(args) > 1 else [])):
            self.note("boolean-mask indexing")
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def builds(self) -> int:
        return self.counts["build"]

    @property
    def reads(self) -> int:
        return self.total - self.builds

    def where(self) -> list[str]:
        return [f"{what} x{n} at {f}:{line} ({fn})" for (what, f, fn, line), n in sorted(self.sites.items())]


@contextlib.contextmanager
def counting(allowed=frozenset(), host_only=frozenset()):
    """``with counting() as c: ...``; ``c.total``, ``c.reads``, ``c.builds``, ``c.where()`` afterwards
    (tolist included). ``allowed``: (file, function) pairs whose builds are not counted; ``host_only``:
    (file, function) pairs, files or folders ("placement/") whose reads and builds are not counted
    either, because the tensors they touch live on the host by design (a ledger of host ints, math
    on a host copy made by a counted read)."""
    counter = HostSyncCounter(frozenset(allowed), frozenset(host_only))
    original = torch.Tensor.tolist

    def tolist(self):
        counter.note("tolist")
        return original(self)

    torch.Tensor.tolist = tolist
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = original
