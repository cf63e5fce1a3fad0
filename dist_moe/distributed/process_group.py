"""Process-group set-up from the launcher's environment (torchrun or the deepspeed launcher)."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from dist_moe.config.choices import DEVICES
from dist_moe.distributed.groups import release_subgroups
from dist_moe.errors import CollectiveError


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




def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(choice: str = "auto") -> torch.device:
    """``parallel.device``: the CPU, or this process's GPU (LOCAL_RANK, or cuda:0 when a scheduler isolated
    one GPU for it); auto takes a GPU when one is visible, except on an emulated cluster
    (``device_choice.choose_device``). A group that already
    exists decides (NCCL: its GPU; gloo: the CPU)."""
    from dist_moe.distributed.device_choice import choose_device, emulated_nodes, own_gpu

    if choice not in DEVICES:
        raise ValueError(f"parallel.device must be one of {DEVICES}, got {choice!r}")
    nodes_on_host = emulated_nodes()
    if dist.is_initialized():
        nccl = dist.get_backend() == "nccl"
        if choice == "cuda" and not nccl or choice == "cpu" and nccl:
            raise ValueError(f"parallel.device={choice} but the process group that exists already is "
                             f"{dist.get_backend()} (NCCL runs on GPUs, gloo here on the CPU)")
        choice, nodes_on_host = ("cuda" if nccl else "cpu"), 1  # the group's device stands
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return choose_device(choice, gpus, local_rank(), nodes_on_host, own_gpu())


def group_options(device: torch.device, timeout_s: float) -> dict:
    """``init_process_group`` keywords for ``device``: NCCL bound to this process's GPU, or gloo.
    The backend follows the device chosen, not whether some GPU happens to be visible."""
    options: dict = {"backend": "nccl" if device.type == "cuda" else "gloo",
               "timeout": datetime.timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        options["device_id"] = device  # NCCL's communicator is made for this GPU at once
    return options


def init_from_env(timeout_s: float = 300.0, always: bool = False, device: torch.device | None = None):
    """Join the launched group on ``device`` (default: the CPU); returns (rank, world, group or None).

    On a GPU the device is set first (``torch.cuda.set_device``), so everything that uses "the
    current device" (NCCL, DCP's object collectives, Megatron) uses this process's GPU. A single
    process gets no group unless ``always`` (engines that need one even alone); MASTER_ADDR /
    MASTER_PORT must then be set (``Runtime`` sets them).
    """
    device = device if device is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = launched_world_size()
    if world == 1 and not dist.is_initialized() and not always:
        return 0, 1, None
    if not dist.is_initialized():
        dist.init_process_group(**group_options(device, timeout_s))
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD


def shutdown(wait: bool = True) -> None:
    """Leave the group; ``wait=False`` after a failure (a lost peer would never arrive)."""
    if dist.is_initialized():
        if wait:
            barrier(dist.group.WORLD)  # nobody tears down while a peer still has collectives in flight
        release_subgroups()
        dist.destroy_process_group()


def collective_failure(error: BaseException, rank: int, world: int, timeout_s: float) -> CollectiveError | None:
    """A clear error for a failed collective (gloo/NCCL raise RuntimeError or DistError), else None."""
    text = str(error)
    # gloo's words when an operation in flight outlives its timeout: "Application timeout caused pair closure"
    signs = ("Connection reset", "Connection closed", "Connection refused", "Timed out", "timed out",
             "Broken pipe", "Socket", "socket", "NCCL", "gloo", "DistNetworkError", "No route to host",
             "pair closure")
    if not isinstance(error, (getattr(dist, "DistError", RuntimeError), RuntimeError)) or not any(
            s in text or s in type(error).__name__ for s in signs):
        return None
    return CollectiveError(
        f"rank {rank} of {world}: a collective failed, so this rank stops. A peer rank died or was killed, the "
        f"network between ranks went down, or a peer did not answer within parallel.timeout_s={timeout_s:g} s. "
        f"Check the other ranks' logs; resume from the last checkpoint with train.resume=true. "
        f"(backend: {text.splitlines()[0][:300] if text else type(error).__name__})")


def barrier(group=None) -> None:
    """Wait for every rank of ``group``; nothing without one (on NCCL, on this process's GPU)."""
    if group is not None and dist.is_initialized():
        if dist.get_backend(group) == "nccl":
            dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier(group=group)
