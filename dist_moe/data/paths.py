"""Where datasets are cached, and how a cache is written."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from placement import read_npz
from placement.files import replacing


def data_dir() -> Path:
    """Project data directory: $DIST_MOE_DATA, else ./data."""
    return Path(os.environ.get("DIST_MOE_DATA", "data"))


def save_cache(cache: Path, **arrays) -> None:
    """Write arrays as ``cache`` (.npz, read back without pickle). Each writer's temporary file has a
    fresh name (``replacing``: never through a link planted at a name known beforehand), renamed into
    place: ranks that fill a cache together never rename each other's, and a crash never leaves a
    half-written cache."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    with replacing(cache) as f:
        np.savez(f, **arrays)


def load_cache(cache: Path, arrays: dict[str, tuple[str, int]], same_rows=()) -> dict | None:
    """The arrays of ``cache``, or None if there is none yet; a cache that is not an .npz, lacks a key or
    holds another type or shape is refused naming the file and the key (``placement.files.read_npz``)."""
    if not cache.exists():
        return None
    return read_npz(cache, arrays, same_rows, "data cache", "delete it and the next run rebuilds it")
