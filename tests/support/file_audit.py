"""Which files a block of code opens, seen from outside it: Python's audit hook reports every
``open`` (``open``, ``io.open``, ``Path.open``, ``os.open``) whatever the code under test calls."""
from __future__ import annotations

import contextlib
import os
import sys

_recording: list[list[str]] = []


def _hook(event: str, args) -> None:
    if event == "open" and _recording and isinstance(args[0], (str, bytes, os.PathLike)):
        _recording[-1].append(os.path.abspath(os.fsdecode(args[0])))


sys.addaudithook(_hook)  # audit hooks cannot be removed: this one only appends while a block records


@contextlib.contextmanager
def opened_files():
    """``with opened_files() as paths:`` -- ``paths`` lists the absolute path of every file opened inside."""
    paths: list[str] = []
    _recording.append(paths)
    try:
        yield paths
    finally:
        _recording.remove(paths)
