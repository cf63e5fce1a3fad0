"""The device decides the backend and where the process group binds (what a GPU run gets), checked
here without a GPU."""
import datetime

import pytest
import torch

from dist_moe.distributed.device_choice import EMULATED_NODES, choose_device
from dist_moe.distributed.process_group import group_options, resolve_device
from dist_moe.train.config import load_config


def test_the_backend_follows_the_device_not_whether_a_gpu_is_visible():
    gpu = group_options(torch.device("cuda", 3), 120.0)
    assert gpu == {"backend": "nccl", "timeout": datetime.timedelta(seconds=120), "device_id": torch.device("cuda", 3)}
    assert group_options(torch.device("cpu"), 5.0) == {"backend": "gloo", "timeout": datetime.timedelta(seconds=5)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error_and_auto_picks_the_cpu():
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    with pytest.raises(ValueError, match="parallel.device must be one of"):
        resolve_device("tpu")


def test_parallel_device_is_a_checked_config_key():
    assert load_config(None).parallel.device == "auto"
    with pytest.raises(ValueError, match="'parallel.device' must be one of auto, cpu, cuda"):
        load_config(None, ["parallel.device=gpu"])


class _FakeGPUs:
    """``n`` CUDA devices as far as the calls under test can tell: availability, count, the current
    device, and one RNG state per device. ``visible=False`` fakes the RNG calls only (DCP's writer
    would use CUDA streams if a GPU seemed visible)."""

    def __init__(self, monkeypatch, n: int, visible: bool = True):
        self.current, self.states = None, {i: torch.randint(0, 256, (16,), dtype=torch.uint8) for i in range(n)}
        if visible:
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
            monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(self, "current", torch.device(d)))
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[self._index(device)].clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", self._set)

    def _index(self, device) -> int:
        device = torch.device(device)
        assert device.type == "cuda", device
        return device.index if device.index is not None else (self.current.index if self.current else 0)

    def _set(self, state, device="cuda"):
        self.states[self._index(device)] = state.clone()


@pytest.mark.parametrize("local", [0, 2, 3])
def test_each_process_takes_the_gpu_of_its_local_rank(monkeypatch, local):
    from dist_moe.distributed.process_group import init_from_env

    gpus = _FakeGPUs(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_RANK", str(local))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resolve_device("cuda") == torch.device("cuda", local) == resolve_device("auto")
    init_from_env(device=resolve_device("cuda"))  # one process: no group, but its GPU is set first
    assert gpus.current == torch.device("cuda", local)


def test_a_local_rank_past_the_node_s_gpus_is_refused(monkeypatch):
    _FakeGPUs(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ValueError, match="LOCAL_RANK=2, but this node shows 2 CUDA devices"):
        resolve_device("cuda")


@pytest.mark.parametrize("local", [0, 1, 7])
def test_a_task_isolated_to_one_gpu_takes_cuda_0_whatever_its_local_rank(monkeypatch, local):
    """SLURM's srun --gpus-per-task=1: each task's CUDA_VISIBLE_DEVICES names its own GPU, which the task sees
    as its only device, cuda:0, while LOCAL_RANK counts the node's tasks (it was refused for LOCAL_RANK > 0)."""
    from dist_moe.distributed.process_group import init_from_env

    gpus = _FakeGPUs(monkeypatch, 1)
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "CROSS_RANK", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(local + 2))  # the physical GPU: the task sees it as cuda:0
    monkeypatch.setenv("LOCAL_RANK", str(local))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resolve_device("cuda") == torch.device("cuda", 0) == resolve_device("auto")
    init_from_env(device=resolve_device("auto"))
    assert gpus.current == torch.device("cuda", 0)


SHARED_GPU = [  # one GPU every rank of the node sees: LOCAL_RANK 1 has none of its own
    {"CUDA_VISIBLE_DEVICES": None},  # the host's only GPU, shown to every process alike
    {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": ""},
    # torchrun and the deepspeed launcher hand every rank of a node the same CUDA_VISIBLE_DEVICES
    {"CUDA_VISIBLE_DEVICES": "3", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"},
    {"CUDA_VISIBLE_DEVICES": "3", "CROSS_RANK": "0", "LOCAL_SIZE": "2"},
]


@pytest.mark.parametrize("environ", SHARED_GPU, ids=[str(i) for i in range(len(SHARED_GPU))])
def test_one_gpu_that_the_node_s_ranks_share_is_not_taken_by_local_rank_1(monkeypatch, environ):
    _FakeGPUs(monkeypatch, 1)
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "CROSS_RANK", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match="LOCAL_RANK=1, but this node shows 1 CUDA devices"):
        resolve_device("cuda")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resolve_device("cuda") == torch.device("cuda", 0)


def test_deepspeed_is_told_the_gpu_the_model_is_on():
    """DeepSpeed's engine makes cuda:LOCAL_RANK current unless told a device_rank: an isolated task with
    LOCAL_RANK 1 has cuda:0 only."""
    from dist_moe.train.step.steppers import device_args

    assert device_args(torch.device("cpu")) is None  # DeepSpeed's own choice stands
    assert device_args(torch.device("cuda", 0)).device_rank == 0
    assert device_args(torch.device("cuda", 3)).device_rank == 3


def test_a_checkpoint_restores_this_rank_s_gpu_random_stream_bit_for_bit(monkeypatch, tmp_path):
    """A CUDA run saves its GPU's generator (Switch's jitter draws there) with its CPU generator, and
    resume sets it back on that GPU, not on another one."""
    from types import SimpleNamespace

    from dist_moe.train.checkpoint.state import DataCursor, restore_state, save_state

    gpus = _FakeGPUs(monkeypatch, 4, visible=False)
    rt = SimpleNamespace(device=torch.device("cuda", 2), world=1, rank=0, group=None)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cursor = DataCursor(10, 0, 5)
    saved_gpu, saved_cpu = gpus.states[2].clone(), torch.get_rng_state()
    path = save_state(tmp_path / "ckpt", 7, model, opt, cursor, rt)
    untouched = {i: s.clone() for i, s in gpus.states.items() if i != 2}
    gpus.states[2] = torch.zeros(16, dtype=torch.uint8)  # training went on: the streams moved
    torch.rand(5)
    assert restore_state(path, model, opt, DataCursor(10, 0, 5), rt) == 7
    assert torch.equal(gpus.states[2], saved_gpu), "the GPU's random stream was not restored"
    assert torch.equal(torch.get_rng_state(), saved_cpu), "the CPU's random stream was not restored"
    assert all(torch.equal(gpus.states[i], s) for i, s in untouched.items()), "another GPU's stream was changed"


CPU = torch.device("cpu")
CHOICES = [  # (choice, GPUs visible, LOCAL_RANK, emulated nodes on this host) -> device
    ("auto", 0, 0, 1, CPU), ("auto", 4, 3, 1, torch.device("cuda", 3)), ("cpu", 4, 0, 1, CPU),
    ("cuda", 2, 1, 1, torch.device("cuda", 1)),
    # isolated to one GPU by the scheduler (own=True): cuda:0 whatever LOCAL_RANK; an emulated cluster's ranks
    # still take the CPU
    # `make demo`'s 2 emulated nodes x 2 ranks: the CPU whatever the GPU count (1 or 2 GPUs: LOCAL_RANK 1
    # refused or both nodes on cuda:0; 4 or 8: NCCL would bypass the throttled link)
    ("auto", 1, 1, 2, CPU), ("auto", 2, 0, 2, CPU), ("auto", 8, 1, 2, CPU), ("auto", 0, 1, 2, CPU),
]


OWN_GPU = [("cuda", 1, 3, 1, torch.device("cuda", 0)), ("auto", 1, 1, 1, torch.device("cuda", 0)),
           ("auto", 1, 1, 2, CPU), ("cuda", 2, 1, 1, torch.device("cuda", 1))]


@pytest.mark.parametrize("choice, gpus, local, nodes, device", CHOICES)
def test_the_device_choice(choice, gpus, local, nodes, device):
    assert choose_device(choice, gpus, local, nodes) == device


@pytest.mark.parametrize("choice, gpus, local, nodes, device", OWN_GPU)
def test_the_device_choice_of_a_task_with_a_gpu_of_its_own(choice, gpus, local, nodes, device):
    assert choose_device(choice, gpus, local, nodes, own=True) == device


@pytest.mark.parametrize("choice, gpus, local, nodes, message", [
    ("cuda", 0, 0, 1, "no CUDA device is visible"),
    ("cuda", 2, 2, 1, "LOCAL_RANK=2, but this node shows 2 CUDA devices"),
    ("cuda", 8, 0, 2, "parallel.device=cuda on an emulated cluster: its 2 nodes share this host's 8 GPUs"),
])
def test_a_device_that_cannot_be_had_is_refused(choice, gpus, local, nodes, message):
    with pytest.raises(ValueError, match=message):
        choose_device(choice, gpus, local, nodes)


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_an_emulated_clusters_ranks_take_the_cpu_on_a_gpu_host(monkeypatch, gpus):
    """What launch/emulate_cluster.sh's ranks get: it sets the variable, resolve_device reads it."""
    _FakeGPUs(monkeypatch, gpus)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # every process sees the host's GPUs alike
    monkeypatch.setenv(EMULATED_NODES, "2")
    assert resolve_device("auto") == CPU == resolve_device("cpu")
    monkeypatch.delenv(EMULATED_NODES)  # a real node: LOCAL_RANK 1 takes its GPU, or is refused without one
    if gpus > 1:
        assert resolve_device("auto") == torch.device("cuda", 1)
    else:
        with pytest.raises(ValueError, match="LOCAL_RANK=1, but this node shows 1 CUDA devices"):
            resolve_device("auto")
    monkeypatch.setenv(EMULATED_NODES, "two")
    with pytest.raises(ValueError, match=f"{EMULATED_NODES} must be an int >= 1, got 'two'"):
        resolve_device("auto")
