import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# What launches processes: the spawn harness (tests/dist_utils.py), torchrun or a CLI subprocess.
_LAUNCHERS = {"run_workers", "run_cases", "subprocess", "Popen", "_torchrun", "torchrun", "launch", "spawn", "_run",
              "start_ranks"}
_ENGINES = ("deepspeed", "megatron")


def pytest_collection_modifyitems(config, items):
    """Markers from what a test calls, so `make test-fast` needs no list kept by hand: ``multiprocess``
    when the test function calls a launcher itself, ``engine`` when its module or name is DeepSpeed's
    or Megatron's. A file may also set ``pytestmark`` (``slow``: minutes of CPU in one process)."""
    for item in items:
        function = getattr(item, "function", None)
        names = set(function.__code__.co_names) if function is not None else set()
        if names & _LAUNCHERS:
            item.add_marker(pytest.mark.multiprocess)
        where = f"{item.module.__name__} {item.name}".lower() if getattr(item, "module", None) else item.name
        if any(e in where for e in _ENGINES):
            item.add_marker(pytest.mark.engine)
