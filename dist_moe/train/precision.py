"""``train.precision`` and ``train.deterministic``: how a run computes, set once per run.

bf16 runs the model's matmuls in bfloat16 under ``torch.autocast`` while weights, gradients and
optimizer state stay fp32; routers and the combine compute in fp32 as under fp32 (they leave
autocast themselves). fp32 on CUDA lets matmuls use TF32, as Megatron and torchtitan do.
``deterministic`` turns on torch's deterministic algorithms (an op without one raises) and
dist-moe's order-fixed sums, so a rerun on CUDA repeats bit for bit as one on CPU does.
"""
from __future__ import annotations

import contextlib
import os

import torch


def run_precision(asked: str, device: torch.device, gar: bool = False) -> str:
    """``train.precision`` as the run trains: ``auto`` is bf16 on a GPU (torch's fast grouped GEMM is bf16's;
    fp32 takes a per-group loop after a host read) and fp32 on the CPU and under GAR (its factorized
    observations and Gram math are fp32); ``fp32`` and ``bf16`` as asked."""
    if asked != "auto":
        return asked
    return "bf16" if device.type == "cuda" and not gar else "fp32"


def compute_context(device: torch.device, precision: str):
    """What a forward runs under: autocast to bfloat16 for ``bf16``, nothing for ``fp32``."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def set_up(device: torch.device, deterministic: bool) -> tuple:
    """Process-wide settings of a run: TF32 matmuls on CUDA, and torch's deterministic mode when asked.
    Returns what they were, for ``restore``."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.are_deterministic_algorithms_enabled())
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if deterministic:
        # cuBLAS needs a fixed workspace to repeat its reductions (torch's deterministic-mode note)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic)
    return before


def restore(before: tuple) -> None:
    """The process's settings as ``set_up`` found them (a caller's process outlives the run)."""
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, deterministic = before
    torch.use_deterministic_algorithms(deterministic)
