"""DCP's side of a checkpoint: the reader, planner and file system that load a verified checkpoint
(``checkpoint_files.verify``) and nothing else, and DCP's save and load around them.

Its own module because ``torch.distributed.checkpoint`` takes ~1.6 s to import (its DTensor ops),
paid by every rank at start: ``checkpoint`` imports this only when a run saves or resumes.
"""
from __future__ import annotations

import contextlib
import copy
import os
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import StorageMeta

from dist_moe.train.checkpoint.files import METADATA, CheckpointError, Identity, open_regular


class CheckedFileSystem(FileSystem):
    """DCP's file system for a verified checkpoint: it opens the files ``verify`` checked, the same
    inodes unchanged since, and refuses every other path."""

    def __init__(self, root: Path, identities: dict):
        super().__init__()
        self.root, self.identities = Path(root), identities

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        path = Path(path)
        if "r" not in mode or any(c in mode for c in "wa+x"):
            raise CheckpointError(f"checkpoint {self.root}: a verified checkpoint is read, never written ({mode!r})")
        if path.parent != self.root or path.name not in self.identities or path.name == METADATA:
            raise CheckpointError(f"checkpoint {self.root}: refusing to read {str(path)[:200]}, not a verified shard "
                                  "of this checkpoint")
        with open_regular(path) as f:
            if Identity.of(os.fstat(f.fileno())) != self.identities[path.name]:
                raise CheckpointError(f"checkpoint {self.root}: {path.name} changed after it was verified")
            yield f


class VerifiedReader(dcp.FileSystemReader):
    """DCP's file reader, handed the Metadata ``verify`` unpickled instead of reading .metadata itself,
    and opening shards only through ``CheckedFileSystem`` (the files verify hashed, unchanged)."""

    def __init__(self, path: Path, metadata, identities: dict):
        super().__init__(str(path))
        self.fs = CheckedFileSystem(Path(path), identities)
        self._verified = metadata

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"checkpoint {self.path}: per-rank metadata files are not read")
        metadata = copy.deepcopy(self._verified)  # DCP stamps its load id into it
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, except that it never unpickles: DCP's own ``load_bytes`` hands a bytes entry to
    torch's loader with weights_only off. ``verify`` already refuses bytes entries; this is the second
    lock on the same door."""

    def load_bytes(self, read_item, value):
        raise CheckpointError(f"refusing to unpickle checkpoint entry {read_item.dest_index.fqn!r}: dist-moe "
                              "checkpoints hold tensors only")


@contextlib.contextmanager
def _unwrapped():
    """DCP wraps every rank's failure in a CheckpointException, a BaseException whose text is a
    traceback: raise the first rank's own exception instead (an OSError, a size mismatch, ...), or
    its Ctrl-C, which DCP catches as well: the other ranks' failures then only follow from it."""
    try:
        yield
    except CheckpointException as e:
        failures = [exc for exc, _ in e.failures.values()]
        inner = next((exc for exc in failures if isinstance(exc, KeyboardInterrupt)), None) or \
            next((exc for exc in failures if isinstance(exc, Exception)), None)
        if inner is None:
            raise
        raise inner from None


class _RecordingWriter(dcp.FileSystemWriter):
    """DCP's file writer, keeping the names of the files this rank wrote: its shards (every file named
    with the prefix DCP gave this rank's plan, one holding no tensor too), and on the coordinator the
    .metadata."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.written: set[str] = set()

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # its files are written when it returns
        prefix = plan.storage_data.prefix  # "__<rank>_": no other rank's names start with it
        self.written.update(name for name in os.listdir(self.path) if name.startswith(prefix))
        return future

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self.written.add(METADATA)


def save_state(state: dict, directory: Path, group) -> list[str]:
    """Save ``state`` under ``directory`` with DCP; returns the names of the files this rank wrote."""
    writer = _RecordingWriter(directory)
    with _unwrapped(), _one_process_is_meant(group):
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
    return sorted(writer.written)


def load_state(state: dict, path: Path, metadata, identities: dict, group) -> None:
    """Fill the tensors of ``state`` from the verified checkpoint ``path``."""
    with _unwrapped(), _one_process_is_meant(group):
        dcp.load(state, storage_reader=VerifiedReader(path, metadata, identities), planner=TensorsOnlyPlanner(),
                 process_group=group, no_dist=group is None)


@contextlib.contextmanager
def _one_process_is_meant(group):
    """Without a group DCP saves and loads in one process, as asked (``no_dist``), yet warns that it assumes
    so, in the middle of the progress bar: that one warning is left out (every other stays)."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                    category=UserWarning)
        yield
