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


def shutdown(barrier: bool = True) -> None:
    """Leave the group; ``barrier=False`` after a failure (a lost peer would never arrive)."""
    if dist.is_initialized():
        from dist_moe.dispatch.dispatcher import release_node_groups

        if barrier:
            dist.barrier()  # nobody tears down while a peer still has collectives in flight
        release_node_groups()
        dist.destroy_process_group()


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, the network between ranks broke, or the timeout passed."""


def collective_failure(error: BaseException, rank: int, world: int, timeout_s: float) -> CollectiveError | None:
    """A clear error for a failed collective (gloo/NCCL raise RuntimeError or DistError), else None."""
    text = str(error)
    signs = ("Connection reset", "Connection closed", "Connection refused", "Timed out", "timed out",
             "Broken pipe", "Socket", "socket", "NCCL", "gloo", "DistNetworkError", "No route to host")
    if not isinstance(error, (getattr(dist, "DistError", RuntimeError), RuntimeError)) or not any(
            s in text or s in type(error).__name__ for s in signs):
        return None
    return CollectiveError(
        f"rank {rank} of {world}: a collective failed, so this rank stops. A peer rank died or was killed, the "
        f"network between ranks went down, or a peer did not answer within parallel.timeout_s={timeout_s:g} s. "
        f"Check the other ranks' logs; resume from the last checkpoint with train.resume=true. "
        f"(backend: {text.splitlines()[0][:300] if text else type(error).__name__})")


def barrier(group=None) -> None:
    """Wait for every rank of ``group``; nothing without one."""
    if group is not None and dist.is_initialized():
        dist.barrier(group=group)
