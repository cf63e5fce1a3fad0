"""Writing a trained model folder safely: the main rank's failure ends every rank, a full disk is the OS
error it is, and the new folder takes the old one's place whole, so a kill at any moment leaves a complete
model where one was (``swap_in``), and the next export clears what a killed one left (``settle_export``)."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
from pathlib import Path

from dist_moe.optional_engines import engine_import


@contextlib.contextmanager
def os_errors_of_safetensors(where: Path):
    """safetensors reports a failed write as a SafetensorError quoting the OS error ("... No space left on
    device (os error 28)"): it is raised as that OSError, naming ``where``, so a full disk gets the usual
    line."""
    SafetensorError = engine_import("safetensors", "SafetensorError")
    try:
        yield
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(where)) from None


# Linux renameat2(2): swap two paths in one step
AT_FDCWD, RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically (renameat2 with RENAME_EXCHANGE); False where the C library or the
    file system has no such call (other systems, NFS), and nothing moved."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _ready(target: Path) -> Path:
    """Where a complete export waits to be swapped in: a later start can finish the swap from here."""
    return target.with_name(f".{target.name}.new")


def swap_in(folder: Path, target: Path) -> None:
    """Put the complete model ``folder`` at ``target``, which holds a complete model (the previous one or
    this) at every moment a kill could come: one atomic exchange where Linux has it. Elsewhere two renames,
    between which ``target`` is missing and ``settle_export`` finishes the swap at the next start."""
    ready = _ready(target)
    folder.rename(ready)
    if not os.path.lexists(target):
        ready.rename(target)
    elif _exchange(ready, target):
        shutil.rmtree(ready)  # the previous model
    else:
        old = target.with_name(f".{target.name}.old")
        target.rename(old)
        try:
            ready.rename(target)
        except OSError:
            old.rename(target)
            raise
        shutil.rmtree(old)


def settle_export(target: Path) -> bool:
    """Finish what an export stopped by a kill left beside ``target``: a complete model waiting to be
    swapped in takes ``target``'s place if that is missing (else the previous model, put aside); then every
    hidden folder of an export (``.<name>.*``: half-written ones, set-aside ones) is removed. Returns
    whether a model was put in place."""
    placed = False
    if not os.path.lexists(target):
        for waiting in (_ready(target), target.with_name(f".{target.name}.old")):
            if waiting.is_dir() and not waiting.is_symlink():
                waiting.rename(target)
                placed = True
                break
    for left in target.parent.iterdir():
        if left.name.startswith(f".{target.name}."):
            if left.is_dir() and not left.is_symlink():
                shutil.rmtree(left)
            else:
                left.unlink()
    return placed
