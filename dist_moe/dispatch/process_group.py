"""Process-group set-up from the launcher's environment (torchrun or the deepspeed launcher)."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def launched_world_size() -> int:
    """WORLD_SIZE as torchrun and the deepspeed launcher set it; 1 for a plain process."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(raw)
    except ValueError:
        raise ValueError(f"WORLD_SIZE must be an int, got {raw!r}") from None
    if world < 1:
        raise ValueError(f"WORLD_SIZE must be >= 1, got {world}")
    return world


def init_from_env(timeout_s: float = 300.0, always: bool = False):
    """Join the launched group (gloo on CPU, nccl with CUDA); returns (rank, world, group or None).

    A single process gets no group unless ``always`` (engines that need one even alone);
    MASTER_ADDR / MASTER_PORT must then be set (``Runtime`` sets them).
    """
    world = launched_world_size()
    if world == 1 and not dist.is_initialized() and not always:
        return 0, 1, None
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD


def shutdown() -> None:
    if dist.is_initialized():
        from dist_moe.dispatch.dispatcher import release_node_groups

        dist.barrier()  # nobody tears down while a peer still has collectives in flight
        release_node_groups()
        dist.destroy_process_group()


def barrier(group=None) -> None:
    """Wait for every rank of ``group``; nothing without one."""
    if group is not None and dist.is_initialized():
        dist.barrier(group=group)
