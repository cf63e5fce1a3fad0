"""launch/emulate_cluster.sh: 2 namespaces x 2 ranks form one gloo world and leave nothing behind, not even
after a kill -9 of the script; a later run removes what a dead run left."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.launch import wait_gone
from tests.support.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "emulate_cluster.sh"


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _namespaces_of(script_pid: int) -> set[str]:
    """The namespaces one run of the script made (``dm<its pid>n<i>``, ``dm<its pid>sw``): other tests may run
    clusters of their own meanwhile."""
    return {n for n in _namespaces() if re.fullmatch(rf"dm{script_pid}(n\d+|sw)", n)}


def _can_namespace() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    name = f"dmtestprobe{os.getpid()}"  # pytest's workers probe at once
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True)
    if probe.returncode:
        return False
    subprocess.run(["ip", "netns", "del", name])
    return True


needs_netns = pytest.mark.skipif(not _can_namespace(), reason="needs root and iproute2 to create network namespaces")


def _run(*args, timeout=120, **extra_env):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           **extra_env}
    with subprocess.Popen([str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          cwd=ROOT) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.pid = proc.pid  # type: ignore[attr-defined]  # what its namespaces are named by
    return done


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@needs_netns
def test_two_nodes_two_ranks_then_clean():
    """Also: the namespaces of a run whose script is gone (named dm<its pid>...) are removed by this run."""
    stale = f"dm{_dead_pid()}n0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    r = _run("--nodes", "2", "--procs-per-node", "2", "--port", str(free_port()),
             str(ROOT / "tests/support/scripts/cluster_check.py"))
    after = _namespaces()
    subprocess.run(["ip", "netns", "del", stale], capture_output=True)  # left if the run did not remove it
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CLUSTER OK node=2,gpu=2" in r.stdout
    assert "inter-node link 400mbit" in r.stderr
    assert stale not in after and not _namespaces_of(r.pid)
    # every node names its peers (torch's store looks each one up): no c10d warning; the names go with the run
    assert "cannot be retrieved" not in r.stdout + r.stderr, r.stderr
    assert not list(Path("/etc/netns").glob(f"dm{r.pid}*"))


@needs_netns
def test_kill_9_of_the_script_stops_every_rank_and_removes_its_namespaces(tmp_path):
    """A kill -9 runs no trap: each node's supervise.py (the script's child) stops its launcher, the ranks
    die with their launcher (launch/rank.py), and a watcher removes the namespaces and the run's folder.
    Before: the namespaces stayed and all ranks went on training."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "MARK_DIR": str(tmp_path), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([str(SCRIPT), "--nodes", "2", "--procs-per-node", "1", "--port", str(free_port()),
                             str(ROOT / "tests/support/scripts/sleep_forever.py")], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 90
    while len(list(tmp_path.glob("rank*.pid"))) < 2:  # both ranks are up
        assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert _namespaces_of(proc.pid)
    start = time.monotonic()
    proc.kill()  # the script alone, not its process group
    proc.wait()
    left = wait_gone(pids, 30)
    print(f"\nkill -9 of emulate_cluster.sh: both ranks gone {time.monotonic() - start:.1f} s later")
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], "ranks still running after the script's kill -9"
    while (_namespaces_of(proc.pid) or list(tmp_path.glob("dist-moe-launch*"))) and time.monotonic() < deadline + 30:
        time.sleep(0.2)
    assert not _namespaces_of(proc.pid) and not list(tmp_path.glob("dist-moe-launch*"))
    print(f"namespaces and the run's folder gone {time.monotonic() - start:.1f} s after the kill")


@needs_netns
def test_a_failing_node_fails_the_run_and_cleans_up(tmp_path):
    """A rank that exits non-zero without a dist-moe line: one line saying which, naming torchrun's report,
    which is kept with the node logs; the rest of the run's folder is removed."""
    bad = tmp_path / "fail_on_node1.py"
    bad.write_text("import os, sys\nsys.exit(3 if os.environ['GROUP_RANK'] == '1' else 0)\n")
    r = _run("--nodes", "2", "--procs-per-node", "1", "--port", str(free_port()), str(bad), TMPDIR=str(tmp_path))
    assert r.returncode != 0
    assert "node<i>.log" in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("dist-moe: error: rank 1 exited with code 3 without an error line"), r.stderr
    kept = sorted(p.name for p in tmp_path.glob("dist-moe-launch*/*"))
    assert kept[-1] == "node1.log" and kept[:-1] and all(k.startswith("launcher-") for k in kept[:-1]), kept
    assert kept[0] in last  # the report it names
    assert not _namespaces_of(r.pid)


def test_loopback_fallback_says_the_link_is_not_throttled():
    r = _run("--nodes", "2", "--procs-per-node", "1", "--port", str(free_port()),
             str(ROOT / "tests/support/scripts/cluster_check.py"),
             EMULATE_CLUSTER_LOOPBACK="1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "NOT throttled" in r.stderr and "CLUSTER OK node=2,gpu=1" in r.stdout


def test_the_emulated_nodes_ranks_take_the_cpu_on_a_gpu_host(tmp_path):
    """Every rank of every emulated node is told it shares the host (`make demo` on a GPU host): with 4 GPUs
    faked visible, parallel.device=auto is the CPU on both nodes (a node whose rank took a GPU exits 3)."""
    script = tmp_path / "device_of_rank.py"
    script.write_text(f"""import os, sys
import torch
sys.path.insert(0, {str(ROOT)!r})
torch.cuda.is_available, torch.cuda.device_count = lambda: True, lambda: 4
from dist_moe.distributed.process_group import resolve_device
device = resolve_device("auto")
print("rank", os.environ["RANK"], "device", device, flush=True)
sys.exit(0 if device.type == "cpu" else 3)
""")
    r = _run("--nodes", "2", "--procs-per-node", "2", "--port", str(free_port()), str(script),
             EMULATE_CLUSTER_LOOPBACK="1", TMPDIR=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert len([line for line in r.stdout.splitlines() if line.endswith(" device cpu")]) == 2  # node 0's ranks


def test_usage_errors():
    r = _run("--nodes", "x", "script.py")
    assert r.returncode == 2 and "integers" in r.stderr
    r = _run()
    assert r.returncode == 2 and "no SCRIPT" in r.stderr
    r = _run("--rate", "bogus", "script.py")  # before: exit 1 with tc's text, after building the namespaces
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "emulate_cluster.sh: --rate takes a rate such as 400mbit, 1gbit or 50mbps, got 'bogus'"]
