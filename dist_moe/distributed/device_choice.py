"""Which device a rank trains on (``parallel.device``), from what its host shows: a pure function of the
visible GPU count, LOCAL_RANK, how many emulated nodes share the host and whether a scheduler gave the
process a GPU of its own, so every case is testable without a GPU; and how a host tensor gets there
(``to_device``)."""
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


def own_gpu() -> bool:
    """Whether a scheduler gave this process one GPU of its own: ``CUDA_VISIBLE_DEVICES`` names exactly one
    device (SLURM's ``srun --gpus-per-task=1`` or ``--gpu-bind``, one task per GPU), and no launcher started
    this process together with other ranks of its node: torchrun (``TORCHELASTIC_RUN_ID``) and the deepspeed
    launcher (``CROSS_RANK``) hand all of them the same variable, so they would share that GPU. Without the
    variable a host's only GPU is shown to every process alike: nothing was isolated."""
    env = os.environ
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None or len([d for d in raw.split(",") if d.strip()]) != 1:
        return False
    torchrun = "TORCHELASTIC_RUN_ID" in env and env.get("LOCAL_WORLD_SIZE", "1") != "1"
    deepspeed = "CROSS_RANK" in env and env.get("LOCAL_SIZE", "1") != "1"
    return not (torchrun or deepspeed)


def choose_device(choice: str, gpus: int, local_rank: int, nodes_on_host: int = 1,
                  own: bool = False) -> torch.device:
    """``choice`` (auto, cpu or cuda) made concrete: a GPU is this rank's own, ``cuda:LOCAL_RANK``; auto
    takes it when a GPU is visible. A process that a scheduler isolated to one GPU (``own``: ``own_gpu()``)
    sees it as cuda:0 whatever its LOCAL_RANK: each task's CUDA_VISIBLE_DEVICES names another physical GPU.
    The ranks of emulated nodes (``nodes_on_host`` > 1) run on the CPU: every node's LOCAL_RANK 0 would take
    cuda:0 (NCCL refuses two ranks on one GPU), and NCCL between GPUs of one host would bypass the
    throttled link that the emulation measures."""
    if choice == "auto":
        choice = "cuda" if gpus and nodes_on_host == 1 else "cpu"
    if choice == "cpu":
        return torch.device("cpu")
    if not gpus:
        raise ValueError("parallel.device=cuda, but no CUDA device is visible (torch.cuda.is_available() is False)")
    if nodes_on_host > 1:
        raise ValueError(f"parallel.device=cuda on an emulated cluster: its {nodes_on_host} nodes share this "
                         f"host's {gpus} GPUs, so each node's LOCAL_RANK 0 would take cuda:0; use parallel.device=cpu")
    if gpus == 1 and own:
        return torch.device("cuda", 0)
    if local_rank >= gpus:
        raise ValueError(f"LOCAL_RANK={local_rank}, but this node shows {gpus} CUDA devices: start at most {gpus} "
                         "processes per node (--nproc-per-node / --num_gpus), or give each process a GPU of its "
                         "own (CUDA_VISIBLE_DEVICES naming one device, as srun --gpus-per-task=1 sets it)")
    return torch.device("cuda", local_rank)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: to a GPU from pinned memory without blocking (the copy is queued
    behind the step's kernels instead of waiting for them)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
