import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# What launches processes: the spawn harness (tests/dist_utils.py), torchrun or a CLI subprocess.
_LAUNCHERS = {"run_workers", "run_cases", "subprocess", "Popen", "_torchrun", "torchrun", "spawn", "start_ranks"}
_ENGINES = ("deepspeed", "megatron")


def pytest_collection_modifyitems(config, items):
    """Markers from what a test calls, so `make test-fast` needs no list kept by hand: ``multiprocess``
    when the test function calls a launcher itself, ``engine`` when its module or name is DeepSpeed's
    or Megatron's. A file may also set ``pytestmark`` (``slow``: minutes of CPU in one process)."""
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and _names(function.__code__) & _LAUNCHERS:
            item.add_marker(pytest.mark.multiprocess)
        name = getattr(item, "originalname", item.name)  # not its parameters' ids
        where = f"{item.module.__name__} {name}".lower() if getattr(item, "module", None) else name
        if any(e in where for e in _ENGINES):
            item.add_marker(pytest.mark.engine)


def _names(code) -> set:
    """The global and attribute names ``code`` uses, its nested code (comprehensions, lambdas) included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names
