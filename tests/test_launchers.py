"""launch/torchrun.sh, launch/deepspeed.sh and emulate_cluster.sh --launcher deepspeed run dist-moe training."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--quiet", "data.max_rows=2000", "train.epochs=2", "train.batch_size=64"]


def _env(tmp_path):
    env = {**os.environ, "DIST_MOE_DATA": str(tmp_path / "data"), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("WORLD_SIZE", None)
    return env


def _summary(proc, out):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_torchrun_script_runs_two_processes(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([str(ROOT / "launch/torchrun.sh"), "--nproc", "2", "--port", str(free_port()), *SMALL,
                           f"output.dir={out}", "parallel.dedup=node"], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=240)
    s = _summary(proc, out)
    assert s["engine"] == "torch" and s["world_size"] == 2 and s["topology"] == "node=1,gpu=2"


def test_deepspeed_script_runs_the_deepspeed_engine(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    proc = subprocess.run([str(ROOT / "launch/deepspeed.sh"), "--num_gpus", "2", "--master_port", str(free_port()),
                           "--", *SMALL, f"output.dir={out}"], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=240)
    s = _summary(proc, out)
    assert s["engine"] == "deepspeed" and s["world_size"] == 2


def test_deepspeed_no_ssh_nodes_on_the_emulated_cluster(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    cmd = [str(ROOT / "launch/emulate_cluster.sh"), "--nodes", "2", "--procs-per-node", "1", "--port",
           str(free_port()), "--launcher", "deepspeed", str(Path(sys.executable).parent / "dist-moe"), "train",
           *SMALL, "engine=deepspeed", f"output.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
    s = _summary(proc, out)
    # each node started its own launcher (--no_ssh --node_rank i); the topology came from its variables
    assert s["engine"] == "deepspeed" and s["world_size"] == 2 and s["topology"] == "node=2,gpu=1"


def test_launcher_option_errors(tmp_path):
    proc = subprocess.run([str(ROOT / "launch/emulate_cluster.sh"), "--launcher", "mpirun", "x.py"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "torchrun or deepspeed" in proc.stderr
    proc = subprocess.run([str(ROOT / "launch/torchrun.sh"), "--nproc", "two"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "'two'" in proc.stderr
    proc = subprocess.run([str(ROOT / "launch/torchrun.sh"), "--nproc", "0"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "positive integer, got '0'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("script", ["torchrun.sh", "emulate_cluster.sh"])
def test_the_first_ranks_error_is_the_launchers_last_line(tmp_path, script):
    """Below torchrun's ChildFailedError report, the script repeats the first rank's line and exits
    with its code (2 for a bad config; torchrun itself says 1 for any failure)."""
    if script == "torchrun.sh":
        cmd = [str(ROOT / "launch/torchrun.sh"), "--nproc", "2", "--port", str(free_port()), "data.name=nope"]
    else:
        cmd = [str(ROOT / "launch/emulate_cluster.sh"), "--nodes", "2", "--procs-per-node", "1", "--port",
               str(free_port()), str(Path(sys.executable).parent / "dist-moe"), "train", "data.name=nope"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("dist-moe: error: data.name must be one of"), proc.stderr[-2000:]
