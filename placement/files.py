"""Reading the package's YAML files (topologies, placements) with errors that name the problem, and
writing files in place of others without following a planted link."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import yaml


def read_yaml_mapping(path, what: str, required=(), optional=()) -> dict:
    """A YAML mapping with exactly the allowed keys, or a ValueError naming what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{what} file {str(path)!r} is not valid YAML: {e}") from None
    allowed = sorted((*required, *optional))
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {path} must hold a mapping with keys {allowed}")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {what} key {unknown[0]!r} in {path}; valid keys: {allowed}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"{what} file {path} needs {missing[0]!r}")
    return data


@contextlib.contextmanager
def replacing(path):
    """A binary file that becomes ``path`` when the block ends. It is written beside ``path`` under a
    fresh name (``mkstemp``: O_EXCL, so never through a planted link) and renamed over it: a reader
    never sees half a file, and a symlink planted at ``path`` is replaced, not written through."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` (text as UTF-8), never writing through a link (``replacing``)."""
    with replacing(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)
