"""The line each rank started by a launch script prints once its process group is up: the torch build,
device and backend it trains with, so an environment that trains on the CPU on a GPU node (a CPU
wheel, a gloo group) shows at the start, not in the step times."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

# launch/lib.sh sets it for the ranks of its scripts; a plain `dist-moe train` prints nothing more
ASKED = "DIST_MOE_RANK_LINE"


def rank_line(rank: int, world: int, torch_version: str, device: torch.device, backend: str | None,
              gpu_name: str | None = None, experts: str | None = None) -> str:
    """e.g. ``rank 1/4: torch 2.13.0+cpu, device cpu, backend gloo``; on a GPU, how the experts compute."""
    where = f"{device} ({gpu_name})" if gpu_name else str(device)
    line = f"rank {rank}/{world}: torch {torch_version}, device {where}, backend {backend or 'none (one process)'}"
    return line + (f", experts: {experts}" if experts else "")


def say_rank_line(rank: int, world: int, device: torch.device, group, experts: str | None = None) -> None:
    if os.environ.get(ASKED) != "1":
        return
    backend = dist.get_backend(group) if group is not None else None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    # the line and its newline in one write: the ranks share the launcher's unbuffered stdout, where
    # print's two writes let two ranks' lines run together
    sys.stdout.write(rank_line(rank, world, torch.__version__, device, backend, gpu, experts) + "\n")
    sys.stdout.flush()
