import os
import types

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# What launches processes: the spawn harness (tests/support/dist_utils.py), torchrun or a CLI subprocess.
_LAUNCHERS = {"run_workers", "run_cases", "subprocess", "Popen", "_torchrun", "torchrun", "spawn", "start_ranks"}
_ENGINES = ("deepspeed", "megatron")


def pytest_collection_modifyitems(config, items):
    """The one rule for ``multiprocess`` and ``engine``, so `make test-fast` needs no list kept by hand and no
    file sets them: ``multiprocess`` when the test function, or a fixture it takes, calls a launcher (itself or
    through its module's helpers), ``engine`` when its module or its name with its parameters' ids names DeepSpeed
or Megatron. ``slow``
    (many seconds of CPU in one process) is the one marker a file sets by hand."""
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and _reached(function) & _LAUNCHERS or _fixtures_reach(item) & _LAUNCHERS:
            item.add_marker(pytest.mark.multiprocess)
        where = f"{item.module.__name__} {item.name}" if getattr(item, "module", None) else item.name
        if any(e in where.lower() for e in _ENGINES):
            item.add_marker(pytest.mark.engine)


def _fixtures_reach(item) -> set:
    """The names the fixtures a test takes use (``_reached``), its conftest's and modules' fixtures alike."""
    info = getattr(item, "_fixtureinfo", None)
    names: set = set()
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        for fixture in defs:
            func = getattr(fixture.func, "__wrapped__", fixture.func)
            if isinstance(func, types.FunctionType) and func.__module__ != __name__:
                names |= _reached(func)
    return names


def _names(code) -> set:
    """The global and attribute names ``code`` uses, its nested code (comprehensions, lambdas) included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names


def _reached(function, seen=None) -> set:
    """The names ``function`` uses, and those of the functions of its own module that it calls, transitively."""
    seen = set() if seen is None else seen
    seen.add(function)
    names = _names(function.__code__)
    for name in list(names):
        helper = function.__globals__.get(name)
        if isinstance(helper, types.FunctionType) and helper.__module__ == function.__module__ and helper not in seen:
            names |= _reached(helper, seen)
    return names
