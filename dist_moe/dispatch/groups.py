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
"""
from __future__ import annotations

import weakref


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
