"""Run a function on N gloo ranks (torch.multiprocessing), each on a free port, with a timeout."""
from __future__ import annotations

import os
import socket
import time

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, args):
    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=__import__("datetime").timedelta(seconds=60))
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # nobody tears down while a peer still has collectives in flight
    finally:
        from dist_moe.dispatch.dispatcher import release_node_groups

        release_node_groups()
        dist.destroy_process_group()
    # The rank now exits the way a user's script does: interpreter teardown included, so an
    # abort at exit fails the test (dist_moe/dispatch/groups.py explains the one that did).


def run_workers(fn, world_size: int = 2, args=(), timeout: float = 120.0) -> None:
    """Raise if any rank fails; kill every rank and fail if they take longer than ``timeout``."""
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{world_size} ranks did not finish within {timeout:.0f} s")
