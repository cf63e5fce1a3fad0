"""benchmarks/gpu_check.py in its --cpu mode (CUDA mapped to the CPU): the expert-parallel checks
pass on one gloo rank (and the multi-rank one on two), as do the local path's sync count, the grouped GEMM's
edges and the wire's bytes; and a tensor built from Python data in the dispatch plan fails the sync
check, naming the line (on a GPU the same build raises under set_sync_debug_mode("error"))."""
from tests.support.dist_utils import run_workers


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
