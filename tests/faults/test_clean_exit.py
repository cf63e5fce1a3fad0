"""A job that succeeded exits 0: no abort in interpreter teardown (dist_moe/distributed/groups.py).

Before the fix, 8 of 12 such 4-rank runs with node dedup died at exit with `terminate called
without an active exception` (SIGABRT), so torchrun reported the job FAILED."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.dist_utils import free_port

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "scripts" / "exit_after_layers.py"


@pytest.mark.parametrize("dedup,nproc,runs", [("node", 4, 2), ("rank", 2, 2)])
def test_torchrun_scripts_with_live_layers_exit_zero(dedup, nproc, runs):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIST_MOE_TOPOLOGY": f"node=2,gpu={nproc // 2}"}
    for i in range(runs):
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                            str(nproc), "--master-port", str(free_port()), str(SCRIPT), dedup],
                           capture_output=True, text=True, timeout=180, env=env)
        assert r.returncode == 0, f"run {i}: {(r.stdout + r.stderr)[-3000:]}"
        assert r.stdout.count("OK") == nproc and "terminate called" not in r.stderr
