"""A save's manifest entries: every rank hashes (SHA-256) the files it wrote, and the ranks wait for the slowest
one in short collectives, never in one as long as its hash.

A rank's shard of a large model takes long to hash, and the ranks' shards and disks differ. A rank done first
that waited for the others in one collective could outlast ``parallel.timeout_s`` (gloo's timeout, NCCL's
watchdog), which bounds each collective, not the save: the save would fail on a slow disk, the run with it. So
a rank hashes a slice (``SLICE_S``) at a time, and after each slice every rank says in one small all-reduce
whether it still has bytes to hash: the longest any rank waits in one collective is about a slice (and one
block's read and hash), whatever the checkpoint's size. Then one all-gather of the small (name -> size,
SHA-256) maps, which stops every rank if one could not hash.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
from pathlib import Path

import torch.distributed as dist

from dist_moe.distributed.reductions import all_reduce_max, group_size
from dist_moe.train.checkpoint.files import CheckpointError, open_regular

BLOCK = 1 << 20  # bytes read and hashed at once
SLICE_S = 1.0  # seconds a rank hashes between two meetings of every rank: far under any parallel.timeout_s


class FileHashes:
    """``{name: {"bytes", "sha256"}}`` (``files``) of the files ``names`` under ``path``, each made 0600 first,
    computed a slice at a time: ``advance(seconds)`` hashes on until the time is spent or ``done``."""

    def __init__(self, path: Path, names):
        self.path, self.todo, self.files = Path(path), list(names), {}
        self._file = contextlib.ExitStack()  # the file being hashed, open across slices
        self._current = None  # (its name, the file, its size, the hash so far)

    @property
    def done(self) -> bool:
        return not self.todo and self._current is None

    def advance(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.done and time.monotonic() < deadline:
            if self._current is None:
                name = self.todo.pop(0)
                os.chmod(self.path / name, 0o600)
                f = self._file.enter_context(open_regular(self.path / name))
                self._current = (name, f, os.fstat(f.fileno()).st_size, hashlib.sha256())
            name, f, size, h = self._current
            block = f.read(BLOCK)
            if block:
                h.update(block)
                continue
            self.files[name] = {"bytes": size, "sha256": h.hexdigest()}
            self.close()

    def close(self) -> None:
        """Close the file being hashed, if any (after a failure: the rest is not hashed)."""
        self._file.close()
        self._current = None


def hash_files(path: Path, names) -> dict[str, dict]:
    """``FileHashes`` of ``names`` at once: one process, nobody waiting."""
    hashes = FileHashes(path, names)
    try:
        hashes.advance(math.inf)
    finally:
        hashes.close()
    return hashes.files


def hashed_by_their_writers(tmp: Path, written: list[str], group) -> dict[str, dict]:
    """Every rank's entries for the manifest of ``tmp``: this rank hashes ``written``, the files it wrote, a slice
    at a time between the ranks' all-reduces (module docstring), then one all-gather of every rank's."""
    hashes, error = FileHashes(tmp, written), None
    try:
        while True:
            if error is None and not hashes.done:
                try:
                    hashes.advance(SLICE_S)
                except (OSError, CheckpointError) as e:
                    error = e
            if not all_reduce_max(int(error is None and not hashes.done), group):  # some rank still hashing
                break
    finally:
        hashes.close()
    report = (None if error is None else str(error), hashes.files)  # plain strings and ints, never from disk
    gathered = [report]
    if group_size(group) > 1:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, report, group=group)
    if error is not None:  # this rank's own, its type kept; the others name it below
        raise error
    files: dict[str, dict] = {}
    for rank, (failed, entries) in enumerate(gathered):
        if failed:
            raise CheckpointError(f"checkpoint {tmp}: rank {rank} could not hash the files it wrote ({failed})")
        if set(entries) & set(files):
            raise CheckpointError(f"checkpoint {tmp}: rank {rank} wrote {sorted(set(entries) & set(files))}, "
                                  "which another rank wrote too")
        files.update(entries)
    return files
