"""The device decides the backend and where the process group binds (what a GPU run gets), checked
here without a GPU."""
import datetime

import pytest
import torch

from dist_moe.dispatch.process_group import group_options, resolve_device
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
    assert load_config(None)["parallel"]["device"] == "auto"
    with pytest.raises(ValueError, match="'parallel.device' must be one of auto, cpu, cuda"):
        load_config(None, ["parallel.device=gpu"])
