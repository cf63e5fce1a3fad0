"""Process groups held weakly, so that ``destroy_process_group()`` really frees them.

torch.distributed owns every group it creates until ``destroy_process_group``.
That call does not stop a gloo group's worker threads (torch 2.13's
``ProcessGroupGloo.shutdown`` leaves them running); only the group's C++
destructor joins them, and it runs when the last Python reference goes. If a
layer, router or autograd node of dist-moe still held the group, that happened
during interpreter finalisation, where a worker thread that was still releasing
its last collective's tensors (a Python decref, so it needs the GIL) was killed
by Python inside a noexcept destructor: ``terminate called without an active
exception``, SIGABRT, a failed job after a successful run.

So dist-moe never keeps a strong reference: objects that use a group hold a
``weakref`` through ``WeakGroup`` (an attribute) or ``weak`` / ``strong`` (a
value), and using a group after it was destroyed raises instead of silently
running without it.

torch holds one itself. ``torch.distributed.nn.functional`` declares its ten
collectives with ``group=group.WORLD``, a default evaluated at import: imported
while a group exists (DCP imports it, through FSDP), those functions hold that
group for the life of the process, in ``__defaults__`` tuples that
``gc.get_referrers`` cannot see. DeepSpeed's ``TorchBackend.barrier`` does the
same, and so do ZeroRedundancyOptimizer and ShardedGradScaler. Every training run
that saved a checkpoint, and every DeepSpeed run, kept WORLD alive past
``destroy_process_group`` that way (the abort at exit seen in 2 of 12 full
suites). ``free_import_time_defaults`` replaces such defaults with None: what
those functions get when imported before the group exists, and read as the
default group; ``release_subgroups`` calls it before it destroys the groups.
"""
from __future__ import annotations

import inspect
import sys
import warnings
import weakref

import torch.distributed as dist
from torch.distributed import ProcessGroup

# the packages whose functions may capture a live group in a default (torch 2.13, deepspeed 0.19.8)
_CAPTURING_PACKAGES = ("torch.distributed", "deepspeed", "megatron")


class DestroyedGroupError(RuntimeError):
    """A dist-moe object was used after its process group was destroyed."""


def weak(group):
    """A weak reference to ``group`` (None stays None)."""
    return None if group is None else weakref.ref(group)


def strong(ref, what: str = "this object"):
    """The group behind ``weak(group)``; raises if it has been destroyed since."""
    if ref is None:
        return None
    group = ref()
    if group is None:
        raise DestroyedGroupError(f"{what} was built on a process group that has since been destroyed "
                                  "(destroy_process_group); build it again on a live group")
    return group


class WeakGroup:
    """A class attribute whose instances hold their process group weakly (``layer.group = g``)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, f"_weak_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return strong(obj.__dict__.get(self.slot), f"{type(obj).__name__}.{self.name}")

    def __set__(self, obj, group) -> None:
        obj.__dict__[self.slot] = weak(group)


def free_import_time_defaults() -> int:
    """Replace every process-group default of the functions and methods of the loaded modules of
    ``_CAPTURING_PACKAGES`` with None; returns how many defaults held a group."""
    freed = 0
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_CAPTURING_PACKAGES):
            continue
        with warnings.catch_warnings():  # looking at a deprecated name (torch.distributed.reduce_op) warns
            warnings.simplefilter("ignore")
            functions = _functions_of(module)
        for fn in functions:
            held = [d for d in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values())
                    if isinstance(d, ProcessGroup)]
            if held:
                freed += len(held)
                fn.__defaults__ = tuple(None if isinstance(d, ProcessGroup) else d for d in fn.__defaults__ or ())
                fn.__kwdefaults__ = {k: None if isinstance(d, ProcessGroup) else d
                                     for k, d in (fn.__kwdefaults__ or {}).items()} or None
    return freed


def _functions_of(module) -> list:
    """The module's own functions and its classes' methods, decorators unwrapped (``__wrapped__``)."""
    found = []
    for value in list(vars(module).values()):
        values = [value]
        if isinstance(value, type) and value.__module__ == module.__name__:
            values += [getattr(m, "__func__", m) for m in vars(value).values()]
        for v in values:
            while inspect.isfunction(v):
                found.append(v)
                v = getattr(v, "__wrapped__", None)
    return found


# subgroups made once per key and reused (the dispatcher's node groups); weak values: torch.distributed owns them
SUBGROUPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def release_subgroups() -> None:
    """Destroy the cached subgroups and drop torch's import-time hold on WORLD (call before
    ``destroy_process_group`` at shutdown)."""
    free_import_time_defaults()
    for sub in list(SUBGROUPS.values()):
        dist.destroy_process_group(sub)
    SUBGROUPS.clear()
