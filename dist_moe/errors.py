"""How a failed ``dist-moe`` command ends: one clear line on stderr and an exit code, never a traceback.

exit 2   the user's input: a config, data, checkpoint or argument that cannot work (ValueError)
exit 1   the run itself failed: a collective (a peer died, the network broke), the disk, the OS,
         or a bug in dist-moe (then the line says so and ``--debug`` shows the traceback)
exit 130 interrupted (Ctrl-C)

Under a launcher every rank prints its line; with ``DIST_MOE_ERROR_DIR`` set (the launch
scripts set it) each rank also writes its exit code and line to ``rank<N>.err`` there, so the
script can repeat the first rank's line as its own last line, below the launcher's noise, and
exit with that rank's code (torchrun's own is 1 for any failure).
"""
from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

USER, RUNTIME, INTERRUPTED = 2, 1, 130


def _line(e: BaseException) -> tuple[str, int]:
    from dist_moe.dispatch.process_group import CollectiveError

    if isinstance(e, KeyboardInterrupt):
        return "interrupted", INTERRUPTED
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
    text = " ".join(text.split())  # one line, whatever the message held
    rank = os.environ.get("RANK")
    line = f"dist-moe: error: {text}" if rank in (None, "0") else f"dist-moe: error (rank {rank}): {text}"
    print(line, file=sys.stderr, flush=True)
    folder = os.environ.get("DIST_MOE_ERROR_DIR")
    if folder:
        try:
            Path(folder, f"rank{rank or 0}.err").write_text(f"{code}\n{line}\n")
        except OSError:
            pass  # the line is on stderr already
    return code
