"""The memory a rank may plan for: what is available on this machine now, shared by the ranks on it."""
from __future__ import annotations

import os

import psutil


def available_per_rank() -> tuple[int, int]:
    """(bytes available to each rank of this machine now, how many ranks share them)."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    return psutil.virtual_memory().available // local, local
