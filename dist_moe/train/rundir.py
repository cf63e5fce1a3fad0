"""A run's output directory: one run at a time, writable before training starts, a finished run never
trained into again by accident (and one replaced on purpose kept until its replacement has finished), run
files never written through a planted symlink, nothing left behind by a run that stopped before its first
step, and a metrics log that a resumed run continues instead of repeating."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from placement import write_atomic

LOCK = ".dist-moe.lock"
METRICS = "metrics.jsonl"
# What dist-moe writes into a run directory, and all that output.overwrite removes: the run's files and
# folders, the routing record (routing_record.record_routing) and dist-moe report's files.
RUN_FILES = ("config.yaml", METRICS, "summary.json", "train_traffic.json", "report.json", "report.md",
             "traffic_heatmap.png", "bytes_by_level.png", "expert_load.png", "tree_distance.png")
RUN_DIRS = ("checkpoints", "tensorboard", "hf_model")  # hf_model: model.kind hf's trained model
_ROUTING = re.compile(r"routing(\.layer[0-9]+)?\.(npz|json)")
HOLDS_A_RUN = (METRICS, "checkpoints", "summary.json")  # any of these: a run trained here
# output.overwrite: the new run trains in STAGING while the run it replaces stays in place, report included;
# once it has finished the old run's files move to PREVIOUS, the new run's take their place, and PREVIOUS goes
STAGING = ".next-run"
PREVIOUS = ".previous-run"


def _ours(name: str) -> bool:
    return (name in RUN_FILES or name in RUN_DIRS or name in (LOCK, STAGING, PREVIOUS)
            or bool(_ROUTING.fullmatch(name)))


def _run_file(name: str) -> bool:
    """One of the files and folders a run consists of (not the lock, nor an overwrite's folders)."""
    return _ours(name) and name not in (LOCK, STAGING, PREVIOUS)


def staging_dir(directory: Path) -> Path:
    """Where an output.overwrite run writes (every rank alike) until it replaces the run in ``directory``."""
    return Path(directory) / STAGING


class RunLock:
    """An exclusive ``flock`` on ``<dir>/.dist-moe.lock`` holding the owner's pid, for the run's life.

    A second run on the same output.dir would interleave checkpoints and overwrite the first's
    metrics; it is refused, naming the directory and the holder. The kernel drops the lock when
    the holder exits, however it exits, so a crashed run never leaves a stale lock behind.
    """

    def __init__(self, directory: Path):
        self.directory, self.path, self.fd = Path(directory), Path(directory) / LOCK, None

    def acquire(self) -> None:
        try:  # O_NOFOLLOW: a lock planted as a symlink would have its target overwritten with our pid
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _link_refused(self.directory, LOCK) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError(f"output.dir {str(self.directory)!r}: {LOCK} is not a regular file; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(f"output.dir {str(self.directory)!r} is in use by another dist-moe run (pid {holder}); "
                             "wait for it to finish or set another output.dir") from None
        self.fd = fd

    def mark(self) -> None:
        """Write our pid, for a second run's message (once this run is sure to train here)."""
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None


class RunDir:
    """Rank 0's hold on the output directory: ``open`` creates it (remembering what it created), refuses
    symlinked run files, takes the lock and refuses a directory that already holds a run unless the
    config resumes or overwrites it; ``discard`` removes what this run created when it stops before
    its first step, and leaves whatever was there before untouched. An overwriting run trains in ``STAGING``
    beside the run it replaces, which stays untouched until ``finish`` swaps the new run in (``stopped_note``
    says where the new run's files are when it stops before)."""

    def __init__(self, path: Path):
        self.path, self.lock = Path(path), RunLock(path)
        self.created: list[Path] = []  # directories this run made, outermost first
        self.before: set[str] = set()  # names in the directory before this run wrote any
        self.held: list[str] = []  # of HOLDS_A_RUN, what was there: a run trained here before
        self.owned = False
        self.staging: Path | None = None  # output.overwrite: STAGING, until the new run is swapped in

    def open(self, resume: bool, overwrite: bool) -> None:
        d = str(self.path)
        parents, p = [], self.path.parent
        while not os.path.lexists(p):
            parents.insert(0, p)
            p = p.parent
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(self.path)  # atomic: of two runs starting together, one made the directory
                self.created = [*parents, self.path]
            except FileExistsError:
                pass
            self.before = set(os.listdir(self.path))
        except OSError as e:
            raise not_writable(self.path, e) from None
        for name in sorted(self.before):
            if _ours(name) and (self.path / name).is_symlink():
                raise _link_refused(self.path, name)
        self.lock.acquire()
        self.owned = True  # from here on this run may remove what it created (before: another run's)
        self.held = held = [name for name in HOLDS_A_RUN if name in self.before]
        if held and not resume and not overwrite:
            raise ValueError(f"output.dir {d!r} already holds a run ({', '.join(held)}): set train.resume=true "
                             "to continue it or output.overwrite=true to replace it, or choose another output.dir")
        if overwrite:
            self._stage()
        self.lock.mark()

    def _stage(self) -> None:
        """A fresh, empty STAGING for the new run: what an earlier replacement that never finished left there
        goes (output.overwrite starts over)."""
        self._remove({STAGING})
        os.mkdir(self.path / STAGING)
        self.before.discard(STAGING)  # this run's own now: discard removes it
        self.staging = self.path / STAGING

    def finish(self) -> None:
        """The new run has finished in STAGING (every rank has written its last file): it replaces the old
        run's files by renames within the directory. The old run is whole until the first rename and the new
        one from the last; a kill in between (a few renames) leaves both folders beside a part of each."""
        if self.staging is None:
            return
        staging, self.staging = self.staging, None
        self._remove({PREVIOUS})  # left by a swap killed midway: that run was being replaced already
        aside = self.path / PREVIOUS
        aside.mkdir(mode=0o700)
        for name in sorted(filter(_run_file, os.listdir(self.path))):
            os.rename(self.path / name, aside / name)  # a link moves as a link: nothing followed
        for name in sorted(filter(_run_file, os.listdir(staging))):  # none of the user's files is replaced
            os.rename(staging / name, self.path / name)
        shutil.rmtree(staging)
        shutil.rmtree(aside)  # unlinks links inside without following them

    def stopped_note(self) -> str | None:
        """For a run stopped after its first step: where an overwriting run's files are (None: not one)."""
        if self.staging is None:
            return None
        return (f"the run in {self.path} is untouched; this run's files, which were to replace it, are in "
                f"{self.staging} (the next output.overwrite=true run starts over)")

    def _remove(self, names) -> None:
        for name in sorted(names):
            path = self.path / name
            if path.is_symlink():  # never remove through a link (open refused one; this one came since)
                raise _link_refused(self.path, name)
            if path.is_dir():
                shutil.rmtree(path)  # rmtree unlinks symlinks inside without following them
            elif path.exists():
                path.unlink()

    def discard(self) -> None:
        """Remove what this run created: the directory when it made it (and the parents it made, while
        they are empty: another run may be starting beside it), else only the run files that were not
        there before (a pre-existing directory keeps all it held). Best effort: the error that stopped
        the run is the one to report."""
        if not self.owned:
            return
        try:
            if self.created:
                if self.path.is_dir() and not self.path.is_symlink():
                    shutil.rmtree(self.path)
                for parent in reversed(self.created[:-1]):
                    if os.path.isdir(parent):
                        os.rmdir(parent)  # fails, and stops here, once a parent holds anything else
            elif self.path.is_dir():
                self._remove({name for name in os.listdir(self.path) if _ours(name) and name not in self.before})
        except (OSError, ValueError):
            pass
        finally:
            self.release()

    def release(self) -> None:
        self.lock.release()


def _link_refused(directory: Path, name: str) -> ValueError:
    return ValueError(f"output.dir {str(directory)!r}: {name} is a symbolic link; dist-moe writes its run files "
                      "only in place, never through a link: remove it or choose another output.dir")


def check_writable(directory: Path) -> None:
    """Create ``directory`` and a file in it, or raise a ValueError that names it (every rank writes there:
    checkpoints are sharded)."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-test-")  # O_EXCL: never through a link
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise not_writable(directory, e) from None


def not_writable(directory: Path, e: OSError) -> ValueError:
    """The error for an output.dir that cannot be made or written: a parent that is a file is named."""
    blocker = next((p for p in (Path(directory), *Path(directory).parents) if p.exists() and not p.is_dir()), None)
    why = f"{str(blocker)!r} is a file, not a folder" if blocker is not None else e.strerror or e
    return ValueError(f"output.dir {str(directory)!r} is not writable: {why}")


def open_metrics(path: Path, append: bool):
    """metrics.jsonl for writing rows: appended to (a resumed run) or new, never through a symlink."""
    if not append:
        path.unlink(missing_ok=True)  # a link is removed, not followed; O_EXCL then makes a new file
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EEXIST):
            raise _link_refused(path.parent, path.name) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"output.dir {str(path.parent)!r}: {path.name} is not a regular file; remove it")
    return os.fdopen(fd, "a" if append else "w")


def truncate_metrics(path: Path, step: int) -> int:
    """Keep the rows of ``metrics.jsonl`` up to ``step`` (the checkpoint a run resumes from): rows a
    killed run wrote after its last checkpoint are trained again and would appear twice. Returns the
    number of rows dropped; the file is replaced atomically."""
    if not path.exists():
        return 0
    rows = path.read_text().splitlines()
    kept = [r for r in rows if _step_of(r) is not None and _step_of(r) <= step]
    if len(kept) != len(rows):
        write_atomic(path, "".join(r + "\n" for r in kept))
    return len(rows) - len(kept)


def _step_of(row: str):
    try:
        return json.loads(row).get("step", 0)
    except ValueError:  # the half-written last row of a killed run
        return None
