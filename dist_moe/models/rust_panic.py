"""A Rust panic inside a pyo3 extension (tokenizers) as Python sees it: a ``PanicException``, a
BaseException, after Rust's panic hook has written its message (with RUST_BACKTRACE, the whole stack) to
file descriptor 2. The caller turns it into one line; these keep the stack off the terminal."""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile


def rust_panics() -> tuple[type[BaseException], ...]:
    """pyo3's PanicException classes: a Rust panic inside tokenizers reaches Python as one, a
    BaseException. Each pyo3 extension makes its own class when it first needs one, so they are looked
    up while an exception is being matched (``except rust_panics()``)."""
    return tuple(c for c in BaseException.__subclasses__()
                 if c.__module__ == "pyo3_runtime" and c.__name__ == "PanicException")


@contextlib.contextmanager
def rust_stderr_held():
    """Run the block with file descriptor 2 going to a temporary file, copied to it afterwards unless a
    Rust panic ended the block: Rust's panic hook writes its message there (with RUST_BACKTRACE, the
    whole stack) before pyo3 raises, and the one error line says it instead."""
    sys.stderr.flush()
    saved = os.dup(2)
    panicked = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except rust_panics():
            panicked = True
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not panicked:
                held.seek(0)
                while chunk := held.read(1 << 16):
                    while chunk:  # a pipe may take part of it
                        chunk = chunk[os.write(2, chunk):]
