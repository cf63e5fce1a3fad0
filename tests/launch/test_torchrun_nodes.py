"""Two `torchrun --nnodes 2 --node_rank i` invocations on loopback: 2 simulated nodes x 2 ranks."""
import os
import subprocess
import sys
from pathlib import Path

from tests.support.dist_utils import free_port

SCRIPT = Path(__file__).parents[1] / "support" / "scripts" / "ep_torchrun.py"


def test_two_torchrun_nodes_detect_topology_and_match_single_process():
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DIST_MOE_TOPOLOGY", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(i),
             "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port, str(SCRIPT),
             "branch", "switch_node_limited", "specdrop"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        for i in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    assert "OK node=2,gpu=2" in outs[0]
