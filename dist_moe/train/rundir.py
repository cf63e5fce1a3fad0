"""A run's output directory: one run at a time, writable before training starts, and a metrics
log that a resumed run continues instead of repeating."""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

LOCK = ".dist-moe.lock"


class RunLock:
    """An exclusive ``flock`` on ``<dir>/.dist-moe.lock`` holding the owner's pid, for the run's life.

    A second run on the same output.dir would interleave checkpoints and overwrite the first's
    metrics; it is refused, naming the directory and the holder. The kernel drops the lock when
    the holder exits, however it exits, so a crashed run never leaves a stale lock behind.
    """

    def __init__(self, directory: Path):
        self.directory, self.path, self.fd = Path(directory), Path(directory) / LOCK, None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(f"output.dir {str(self.directory)!r} is in use by another dist-moe run (pid {holder}); "
                             "wait for it to finish or set another output.dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None


def check_writable(directory: Path) -> None:
    """Create ``directory`` and a file in it, or raise a ValueError that names it (every rank writes there:
    checkpoints are sharded)."""
    probe = Path(directory) / f".write-test-{os.getpid()}"
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"output.dir {str(directory)!r} is not writable: {e.strerror or e}") from None


def truncate_metrics(path: Path, step: int) -> int:
    """Keep the rows of ``metrics.jsonl`` up to ``step`` (the checkpoint a run resumes from): rows a
    killed run wrote after its last checkpoint are trained again and would appear twice. Returns the
    number of rows dropped; the file is replaced atomically."""
    if not path.exists():
        return 0
    rows = path.read_text().splitlines()
    kept = [r for r in rows if _step_of(r) is not None and _step_of(r) <= step]
    if len(kept) != len(rows):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(r + "\n" for r in kept))
        tmp.replace(path)
    return len(rows) - len(kept)


def _step_of(row: str):
    try:
        return json.loads(row).get("step", 0)
    except ValueError:  # the half-written last row of a killed run
        return None
