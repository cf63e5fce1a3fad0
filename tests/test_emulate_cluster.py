"""launch/emulate_cluster.sh: 2 namespaces x 2 ranks form one gloo world and leave nothing behind."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "emulate_cluster.sh"


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _can_namespace() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    probe = subprocess.run(["ip", "netns", "add", "dmtestprobe"], capture_output=True)
    if probe.returncode:
        return False
    subprocess.run(["ip", "netns", "del", "dmtestprobe"])
    return True


needs_netns = pytest.mark.skipif(not _can_namespace(), reason="needs root and iproute2 to create network namespaces")


def _run(*args, timeout=120, **extra_env):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           **extra_env}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@needs_netns
def test_two_nodes_two_ranks_then_clean():
    before = _namespaces()
    r = _run("--nodes", "2", "--procs-per-node", "2", "--port", "29611", str(ROOT / "tests/scripts/cluster_check.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CLUSTER OK node=2,gpu=2" in r.stdout
    assert "inter-node link 400mbit" in r.stderr
    assert _namespaces() == before


@needs_netns
def test_a_failing_node_fails_the_run_and_cleans_up(tmp_path):
    bad = tmp_path / "fail_on_node1.py"
    bad.write_text("import os, sys\nsys.exit(3 if os.environ['GROUP_RANK'] == '1' else 0)\n")
    before = _namespaces()
    r = _run("--nodes", "2", "--procs-per-node", "1", "--port", "29612", str(bad))
    assert r.returncode != 0
    assert "node<i>.log" in r.stderr
    assert _namespaces() == before


def test_loopback_fallback_says_the_link_is_not_throttled():
    r = _run("--nodes", "2", "--procs-per-node", "1", "--port", str(free_port()), str(ROOT / "tests/scripts/cluster_check.py"),
             EMULATE_CLUSTER_LOOPBACK="1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "NOT throttled" in r.stderr and "CLUSTER OK node=2,gpu=1" in r.stdout


def test_usage_errors():
    r = _run("--nodes", "x", "script.py")
    assert r.returncode == 2 and "integers" in r.stderr
    r = _run()
    assert r.returncode == 2 and "no SCRIPT" in r.stderr
