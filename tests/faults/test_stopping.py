"""Ctrl-C or kill of an experiment driver stops everything it launched: no rank keeps running (and
appending rows), no network namespace of the emulated cluster is left behind."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch.test_emulate_cluster import _namespaces
from tests.support.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = str(ROOT / "tests/support/scripts/sleep_forever.py")
DRIVER = "import sys; from experiments.run import run_forwarding, ROOT; sys.exit(run_forwarding(sys.argv[1:], " \
         "dict(__import__('os').environ), ROOT))"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")


def _namespaces_under(driver: int) -> set:
    """The emulated cluster's namespaces (``dm<its script's pid>...``) that this driver's launch made; other
    tests may run clusters of their own meanwhile."""
    return {n for n in _namespaces() if (m := re.match(r"dm(\d+)", n)) and _descends_from(int(m.group(1)), driver)}


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            return False
    return False


@pytest.mark.parametrize("launcher,sig", [("torchrun", signal.SIGTERM), ("emulated", signal.SIGINT)])
def test_stopping_the_driver_stops_its_ranks_and_cleans_up(tmp_path, launcher, sig):
    no_ip = subprocess.run(["which", "ip"], capture_output=True).returncode if launcher == "emulated" else 0
    if launcher == "emulated" and (os.geteuid() != 0 or no_ip):
        pytest.skip("the emulated cluster needs root and iproute2")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MARK_DIR": str(tmp_path)}
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SLEEPER]
    else:
        cmd = ["bash", str(ROOT / "launch/emulate_cluster.sh"), "--nodes", "2", "--procs-per-node", "1",
               "--port", str(free_port()), SLEEPER]
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, *cmd], env=env, cwd=ROOT)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank*.pid"))) < 2:  # both ranks are up
        assert driver.poll() is None and time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    ours = _namespaces_under(driver.pid) if launcher == "emulated" else set()
    if launcher == "emulated":
        assert ours, "no namespaces while the emulated cluster runs"
    driver.send_signal(sig)
    assert driver.wait(timeout=60) != 0
    # no grace period: the driver waits for its launcher, and the launcher for its ranks
    assert not [p for p in pids if _alive(p)], "ranks still running after the driver exited"
    assert not ours & _namespaces(), "namespaces left behind"
