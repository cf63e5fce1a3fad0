"""Every change dist-moe makes to DeepSpeed (written against 0.19.8), in one place.

``apply()`` is idempotent and is called by ``dist_moe.integrations.deepspeed``
before DeepSpeed's communication backend starts.
"""
from __future__ import annotations

import datetime
import importlib

import torch

from dist_moe.optional_engines import engine_import

_APPLIED = False
_GROUP_TIMEOUT: datetime.timedelta | None = None  # what init_distributed was given (None: torch's default)


def apply(cpu: bool | None = None) -> None:
    """``cpu``: the run's device choice (None: the CPU when no GPU is visible)."""
    global _APPLIED
    if _APPLIED:
        return
    if cpu if cpu is not None else not torch.cuda.is_available():
        # 0.19.8: TorchBackend.__init__ JIT-builds a shared-memory comm op (about 100 s on a
        # 2-core CPU, on every start) that only inference all-reduce uses. The module must
        # be reached through importlib: `import deepspeed.comm.torch as m` resolves to the
        # `torch` package re-exported by deepspeed.comm and patches the wrong module.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    # 0.19.8: TorchBackend.new_group passes no timeout, and torch gives a new group its backend's
    # default (30 min on gloo, 10 on NCCL), not the world's: every group DeepSpeed creates (expert,
    # expert-data, data) would outwait the run's timeout behind a hung peer.
    backend = importlib.import_module("deepspeed.comm.torch").TorchBackend
    backend.new_group = lambda self, ranks: torch.distributed.new_group(ranks, timeout=_GROUP_TIMEOUT)
    _APPLIED = True


def time_out_groups(timeout: datetime.timedelta | None) -> None:
    """Every group DeepSpeed creates from now on waits ``timeout`` for a peer, as the world does."""
    global _GROUP_TIMEOUT
    _GROUP_TIMEOUT = timeout


def release_groups() -> None:
    """Drop DeepSpeed's cached process groups (its expert, expert-data, world and model-parallel
    groups). 0.19.8 releases them only when the group is destroyed through deepspeed.comm; a run
    whose group torch destroys would otherwise keep every one alive until interpreter exit, where
    their threads can abort the process (dist_moe/distributed/groups.py). Its dicts hold nothing but
    groups, so the garbage collector cannot see them as referrers either."""
    groups = engine_import("deepspeed.utils", "groups")

    groups._release_process_group_references(group=None)
