"""A run without OMP_NUM_THREADS gets a thread count that leaves room for the rest of the machine."""
import os

import pytest
import torch

from dist_moe.train.runtime import _share_cpu_threads


@pytest.fixture
def threads(monkeypatch):
    """Runs _share_cpu_threads on a pretend machine and returns the torch threads it left."""
    before = torch.get_num_threads()

    def run(cores: int, local=None, omp=None, torch_default: int = 64) -> int:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
        for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMP_NUM_THREADS"):
            monkeypatch.delenv(key, raising=False)
        if local is not None:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        if omp is not None:
            monkeypatch.setenv("OMP_NUM_THREADS", str(omp))
        torch.set_num_threads(torch_default)
        _share_cpu_threads()
        return torch.get_num_threads()

    yield run
    torch.set_num_threads(before)


def test_unset_omp_leaves_a_core_and_shares_the_rest(threads):
    assert threads(cores=2) == 1  # one process on 2 cores: one thread, a core for anything else
    assert threads(cores=8) == 7
    assert threads(cores=17, local=4) == 4  # 4 ranks share the 16 cores left
    assert threads(cores=2, local=4) == 1  # never below one thread


def test_never_more_than_torchs_own_default(threads):
    assert threads(cores=16, torch_default=4) == 4  # torch counts physical cores; affinity counts logical ones


def test_a_set_omp_num_threads_is_left_alone(threads):
    assert threads(cores=2, omp=2, torch_default=2) == 2
    assert threads(cores=8, local=4, omp=8, torch_default=8) == 8
