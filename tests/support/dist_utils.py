"""Run a function on N gloo ranks (torch.multiprocessing, forked from a server that imported torch, dist-moe
and the engines once) that meet through a file store, with a timeout."""
from __future__ import annotations

import gc
import os
import shutil
import socket
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    """A port no other process has bound, for a launcher that must be told one (``--port``).

    Binding port 0 and releasing it hands out an *ephemeral* port, one the kernel may give to any
    outgoing connection (a gloo pair of a run still tearing down) before the launcher binds it.
    Ports below the ephemeral range are never handed out that way: this process walks its own
    stretch of them (from its pid, so a second pytest process walks another) and returns the first
    one that binds."""
    global _next_port
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    span = low - 20000
    for _ in range(span):
        port = 20000 + (_next_port % span)
        _next_port += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in [20000, {low})")


_next_port = (os.getpid() * 97) % 10000


def _entry(rank, fn, world_size, store, args, environ, cwd):
    # a forkserver child starts with the server's environment and folder: the test's are set here
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=__import__("datetime").timedelta(seconds=60))
    groups = []
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # nobody tears down while a peer still has collectives in flight
    finally:
        from dist_moe.distributed.groups import release_subgroups

        world = dist.distributed_c10d._world
        groups = [(weakref.ref(g), world.pg_names.get(g, '?')) for g in world.pg_map]
        if "deepspeed.utils.groups" in sys.modules:  # what a DeepSpeed job's teardown does (shutdown_distributed)
            from dist_moe.integrations.deepspeed.patches import release_groups

            release_groups()
        release_subgroups()
        dist.destroy_process_group()
    gc.collect()
    alive = [name for ref, name in groups if ref() is not None]
    # A group that outlives destroy_process_group keeps its gloo threads until interpreter teardown,
    # where they can abort the process after a successful run (dist_moe/distributed/groups.py): fail
    # every time the holder is back, not in 1 run of 12.
    assert not alive, f"rank {rank}: process groups still alive after destroy_process_group: {alive}"
    # The rank now exits the way a user's script does: interpreter teardown included, so an
    # abort at exit fails the test.


def run_workers(fn, world_size: int = 2, args=(), timeout: float = 120.0) -> None:
    """Raise if any rank fails; kill every rank and fail if they take longer than ``timeout``."""
    folder = tempfile.mkdtemp(prefix="dist-moe-store-")  # a file rendezvous: no port to race for
    try:
        _run(fn, world_size, args, timeout, os.path.join(folder, "store"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_cases(world_size: int, cases: list[tuple], timeout: float = 120.0) -> None:
    """``run_workers`` for several ``(fn, *args)`` cases, ``fn(rank, world, *args)`` one after the
    other on one set of ranks: a rank's start (spawn, imports, rendezvous) costs more than a small
    case. A failing case is named."""
    run_workers(_each_case, world_size, args=(cases,), timeout=timeout)


def _each_case(rank, world_size, cases):
    for fn, *args in cases:
        try:
            fn(rank, world_size, *args)
        except Exception as e:  # re-raised as it is, with the case named in its traceback
            e.add_note(f"in case {fn.__name__}{tuple(args)}")
            raise


# Ranks fork from a server that has imported torch, dist-moe and the engines once: a fresh interpreter per
# rank spent 2-5 s of CPU importing them (Megatron-core alone 3 s), for every rank of every multi-process
# test. What the server cannot import (an engine not installed) is imported by the rank that needs it.
mp.set_forkserver_preload(["torch", "torch.distributed", "numpy", "dist_moe.train.trainer", "tests.support.dist_utils",
                           "deepspeed", "megatron.core.parallel_state", "megatron.core.transformer"])


def _run(fn, world_size, args, timeout, store) -> None:
    ctx = mp.start_processes(_entry, args=(fn, world_size, store, args, dict(os.environ), os.getcwd()),
                             nprocs=world_size, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{world_size} ranks did not finish within {timeout:.0f} s")
