"""A rank that stops answering (SIGSTOP: alive, connected, silent) ends the others within
parallel.timeout_s under every engine: each process group DeepSpeed and Megatron create for
themselves (expert, expert-data, data parallel) carries the run's timeout, not torch's 30 minutes."""
import os
import signal
import time

import pytest

from tests.faults.launch import alive, start_ranks, wait_all

TIMEOUT_S = 6
RUN = ["data.max_rows=2000", "train.max_steps=100000", f"parallel.timeout_s={TIMEOUT_S}"]

# The stopped rank stops itself inside a routing statistic's reduction on a group the engine created
# (BRANCH's anchor sums, a few steps in), so the other rank waits in that reduction, on that group.
STOP_IN_ENGINE_GROUP = """
import os, signal, sys
import torch.distributed as dist
from dist_moe.distributed import reductions as stats
real, calls = stats.reduce_copy, [0]
def stopping(t, group, *rest):
    if group is not None and group != dist.group.WORLD:
        calls[0] += 1
        if calls[0] == 10:
            os.kill(os.getpid(), signal.SIGSTOP)
    return real(t, group, *rest)
stats.reduce_copy = stopping
from dist_moe.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _stopped(pid: int) -> bool:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T"


# each engine, each rank stopped, each dispatcher: the groups are the engine's whichever moves the tokens
@pytest.mark.parametrize("engine,stopped,overrides", [
    ("deepspeed", 1, []),
    ("megatron", 0, ["parallel.dispatcher=dist_moe", "model.capacity_factor=null"]),
])
def test_a_stopped_rank_ends_the_other_within_the_timeout(tmp_path, engine, stopped, overrides):
    out = tmp_path / "run"
    out.mkdir()
    procs = start_ranks(2, [f"engine={engine}", *RUN, *overrides], out, {"DIST_MOE_DATA": str(tmp_path / "data")},
                        code={stopped: STOP_IN_ENGINE_GROUP})
    deadline = time.monotonic() + 120
    while not _stopped(procs[stopped].pid):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, [p.poll() for p in procs]
        time.sleep(0.05)
    stopped_at = time.monotonic()
    survivor = 1 - stopped
    codes = wait_all([procs[survivor]], TIMEOUT_S * 3 + 20)
    took = time.monotonic() - stopped_at
    assert alive(procs[stopped].pid)  # stopped, not dead: nothing closed its connections
    os.killpg(procs[stopped].pid, signal.SIGKILL)
    procs[stopped].wait()
    log = (out / f"rank{survivor}.log").read_text()
    print(f"\n{engine} {overrides}: rank {survivor} stopped {took:.1f} s after rank {stopped} (timeout {TIMEOUT_S} s)")
    assert codes == [1], (codes, took, log[-2000:])
    assert f"rank {survivor} of 2: a collective failed" in log and "Traceback" not in log, log[-2000:]
    assert took < TIMEOUT_S + 10, took  # one timeout and the teardown, not torch's 30 minutes
