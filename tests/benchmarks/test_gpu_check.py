"""benchmarks/gpu_check.py in its --cpu mode (CUDA mapped to the CPU): the expert-parallel checks
pass on one gloo rank (and the multi-rank one on two), as do the local path's sync count, the grouped GEMM's
edges and the wire's bytes; and a tensor built from Python data in the dispatch plan fails the sync
check, naming the line (on a GPU the same build raises under set_sync_debug_mode("error")); and a Python
without torch is told in one line which to run it with."""
import runpy
import sys
from pathlib import Path

import pytest

from tests.support.dist_utils import run_workers

ROOT = Path(__file__).resolve().parents[2]


def _worker(rank, world):
    import torch

    import benchmarks.gpu_check as gpu_check
    from placement.plan import DispatchPlan

    cpu = torch.device("cpu")
    gpu_check.ep_sync(cpu)
    gpu_check.ep_fp32(cpu)
    gpu_check.local_sync(cpu)
    gpu_check.grouped_edges(cpu)
    gpu_check.wire_bytes(cpu)
    assert [r["status"] for r in gpu_check.RESULTS] == ["PASS"] * 5, gpu_check.RESULTS

    original = DispatchPlan.build.__func__

    def build(cls, expert_idx, *args, **kwargs):
        torch.tensor([1, 2], device=expert_idx.device)  # the planted host-to-device build
        return original(cls, expert_idx, *args, **kwargs)

    DispatchPlan.build = classmethod(build)
    gpu_check._RUNS.clear()
    try:
        gpu_check.ep_sync(cpu)
    finally:
        DispatchPlan.build = classmethod(original)
    planted = gpu_check.RESULTS[-1]
    assert planted["status"] == "FAIL" and "build x1 at" in planted["detail"], planted


def test_gpu_check_cpu_mode_passes_and_catches_a_planted_build():
    run_workers(_worker, 1, timeout=240)


def _ranks_worker(rank, world):
    import torch

    import benchmarks.gpu_check as gpu_check

    assert gpu_check.ranks_equal_one_process(rank, world, torch.device("cpu")) <= 1e-4


def test_gpu_check_multi_rank_equality_on_two_gloo_ranks():
    """Its ep ranks check's body (on a GPU: NCCL, launched by torch.multiprocessing.spawn), on every rank."""
    run_workers(_ranks_worker, 2)


def test_a_python_without_torch_is_told_which_python_to_run_it_with(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` then fails as where torch is not installed
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(ROOT / "benchmarks" / "gpu_check.py"), run_name="gpu_check_without_torch")
    assert stopped.value.code == 2
    said = capsys.readouterr().err
    assert said.startswith("gpu_check.py: torch is not installed for ") and ".venv/bin/python" in said, said
    assert len(said.splitlines()) == 1, said
