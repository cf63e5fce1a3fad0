"""How a failed ``dist-moe`` command ends: one clear line on stderr and an exit code, never a traceback.

exit 2   the user's input: a config, data, checkpoint or argument that cannot work (ValueError)
exit 1   the run itself failed: a collective (a peer died, the network broke), the disk, the OS,
         or a bug in dist-moe (then the line says so and ``--debug`` shows the traceback)
exit 130 interrupted (Ctrl-C)

Each line is written with one write() call, so two ranks sharing a terminal never mix their lines.
Under the launch scripts (``DIST_MOE_ERROR_DIR`` set) a rank writes its exit code, the time and its
line to ``rank<N>.err`` there instead of printing it (``DIST_MOE_ERROR_ECHO=1``: print it too, for the
emulated cluster's node logs): the script prints the first failure's line alone and exits with that
rank's code (torchrun's own is 1 for any failure). Under bare torchrun (``TORCHELASTIC_ERROR_FILE`` set)
the line also goes to torchrun's error file, so its failure summary shows it where it would show a
traceback.
"""
from __future__ import annotations

import contextlib
import difflib
import errno
import json
import os
import reprlib
import sys
import time
from pathlib import Path

USER, RUNTIME, INTERRUPTED = 2, 1, 130
MAX_LINE = 1000  # characters of one error line


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, the network between ranks broke, or the timeout passed
    (``dispatch.process_group.collective_failure`` says so in one line: exit 1)."""


def shown(value) -> str:
    """``repr(value)`` for a message, cut to a few hundred characters without walking all of a huge
    value (a YAML list of millions of items once cost 800 MB of stderr)."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = 200
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = 10
    r.maxlevel = 3
    return r.repr(value)


def did_you_mean(key, valid, prefix: str = "") -> str:
    """``" (did you mean 'train.epochs'?)"`` for the valid key closest to a mistyped one, or ``""`` when none is close
    (``prefix``: the section the keys sit in, so the suggestion reads as the key to type)."""
    close = difflib.get_close_matches(str(key), [str(v) for v in valid], n=1)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its type's name when it has none), for a one-line error."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _line(e: BaseException) -> tuple[str, int]:
    if isinstance(e, KeyboardInterrupt):  # its message, when there is one, says how to go on
        return f"interrupted; {e}" if str(e) else "interrupted", INTERRUPTED
    if isinstance(e, ValueError):
        return str(e), USER
    if isinstance(e, CollectiveError):
        return str(e), RUNTIME
    if isinstance(e, OSError):
        where = f" ({e.filename})" if e.filename else ""
        if e.errno == errno.ENOSPC:
            return f"no space left on the device{where}; free space and resume with train.resume=true", RUNTIME
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return f"cannot write{where}: {e.strerror}", USER
        return f"{e.strerror or e}{where}", RUNTIME
    if isinstance(e, MemoryError):
        return "out of memory; lower the batch size, the model size or the simulated cluster", RUNTIME
    return f"internal error {type(e).__name__}: {e} (rerun with --debug for the traceback)", RUNTIME


def report(e: BaseException, debug: bool = False) -> int:
    """Print ``e`` as one line (``dist-moe: error: ...``) and return the exit code; ``debug`` re-raises."""
    if debug:
        raise e
    text, code = _line(e)
    text = " ".join(text[:4 * MAX_LINE].split())  # one line, whatever the message held
    if len(text) > MAX_LINE:  # a message that echoes a pasted file or a huge value
        text = text[:MAX_LINE] + " ... (message cut)"
    rank = os.environ.get("RANK")
    line = f"dist-moe: error: {text}" if rank in (None, "0") else f"dist-moe: error (rank {rank}): {text}"
    if not _leave_to_launch_script(line, code, rank) or os.environ.get("DIST_MOE_ERROR_ECHO") == "1":
        sys.stderr.write(line + "\n")  # one write: under `python -u` print() writes the newline apart
        sys.stderr.flush()
    _torchelastic_error_file(line)
    return code


def _leave_to_launch_script(line: str, code: int, rank: str | None) -> bool:
    """Write the line for a launch script to print (lib.sh's first_error); False if it cannot."""
    folder = os.environ.get("DIST_MOE_ERROR_DIR")
    if not folder:
        return False
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        fd = os.open(Path(folder, f"rank{rank or 0}.err"), flags, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{code} {time.time_ns()}\n{line}\n")
        return True
    except OSError:
        return False  # then the line goes to stderr


def _torchelastic_error_file(line: str) -> None:
    """The error file torchrun's agent reads for this rank, in the JSON of torch's own
    ``ErrorHandler.record_exception`` (torch/distributed/elastic/multiprocessing/errors/error_handler.py)
    with this line where that puts the traceback: torchrun's summary prints ``py_callstack`` as the
    rank's ``traceback`` and takes the earliest ``timestamp`` (whole seconds) as the root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError):  # the line is on stderr (or with the launch script) already
        Path(path).write_text(json.dumps(data))
