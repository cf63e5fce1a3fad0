"""Which device a rank trains on (``parallel.device``), from what its host shows: a pure function of the
visible GPU count, LOCAL_RANK and how many emulated nodes share the host, so every case is testable
without a GPU; and how a host tensor gets there (``to_device``)."""
from __future__ import annotations

import os

import torch

# launch/emulate_cluster.sh sets it: how many emulated nodes run on this one host
EMULATED_NODES = "DIST_MOE_EMULATED_NODES"


def emulated_nodes() -> int:
    """The emulated nodes that share this host (1 outside an emulated cluster)."""
    raw = os.environ.get(EMULATED_NODES, "1")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{EMULATED_NODES} must be an int >= 1, got {raw!r}")
    return int(raw)


def choose_device(choice: str, gpus: int, local_rank: int, nodes_on_host: int = 1) -> torch.device:
    """``choice`` (auto, cpu or cuda) made concrete: a GPU is this rank's own, ``cuda:LOCAL_RANK``; auto
    takes it when a GPU is visible. The ranks of emulated nodes (``nodes_on_host`` > 1) run on the CPU:
    every node's LOCAL_RANK 0 would take cuda:0 (NCCL refuses two ranks on one GPU), and NCCL between
    GPUs of one host would bypass the throttled link that the emulation measures."""
    if choice == "auto":
        choice = "cuda" if gpus and nodes_on_host == 1 else "cpu"
    if choice == "cpu":
        return torch.device("cpu")
    if not gpus:
        raise ValueError("parallel.device=cuda, but no CUDA device is visible (torch.cuda.is_available() is False)")
    if nodes_on_host > 1:
        raise ValueError(f"parallel.device=cuda on an emulated cluster: its {nodes_on_host} nodes share this "
                         f"host's {gpus} GPUs, so each node's LOCAL_RANK 0 would take cuda:0; use parallel.device=cpu")
    if local_rank >= gpus:
        raise ValueError(f"LOCAL_RANK={local_rank}, but this node shows {gpus} CUDA devices: start at most {gpus} "
                         "processes per node (--nproc-per-node / --num_gpus)")
    return torch.device("cuda", local_rank)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: to a GPU from pinned memory without blocking (the copy is queued
    behind the step's kernels instead of waiting for them)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
