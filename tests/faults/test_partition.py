"""The emulated cluster's inter-node link cut mid-training (every rank on both sides stops with a
clear error within the collective timeout; the last checkpoint resumes once the link is back), and
the link throttled far below its rate mid-run (slower, nothing lost)."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from dist_moe.train.checkpoint import store as checkpoint
from tests.faults.launch import wait_for_checkpoint
from tests.launch.test_emulate_cluster import needs_netns
from tests.support.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 15
RUN = ["data.max_rows=3000", "train.batch_size=32", "router.num_experts=8", "router.top_k=2",
       "parallel.dedup=node", "train.checkpoint_every=10", f"parallel.timeout_s={TIMEOUT_S}", "train.log_every=5"]


def _cluster(out: Path, overrides: list[str], tmp: Path) -> subprocess.Popen:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "DIST_MOE_DATA": str(tmp / "data"), "TMPDIR": str(tmp)}
    log = (tmp / f"cluster-{time.monotonic_ns()}.log").open("w")
    return subprocess.Popen(["bash", str(ROOT / "launch/emulate_cluster.sh"), "--nodes", "2", "--procs-per-node", "1",
                             "--port", str(free_port()), str(Path(sys.executable).parent / "dist-moe"), "train",
                             "--quiet", f"output.dir={out}", *RUN, *overrides], env=env, cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, text=True)


def _logs(tmp: Path) -> str:
    """Node 0's stream and node 1's log file (named by emulate_cluster under TMPDIR)."""
    return "\n".join(p.read_text(errors="replace") for p in sorted(tmp.rglob("*.log")))


def _ip(*args):
    subprocess.run(["ip", *args], check=True)


@needs_netns
def test_link_down_stops_both_sides_and_the_checkpoint_resumes(tmp_path):
    out = tmp_path / "run"
    proc = _cluster(out, ["train.max_steps=100000"], tmp_path)
    step = wait_for_checkpoint(out / "checkpoints", 10, [proc], timeout=180)
    ns = f"dm{proc.pid}"  # emulate_cluster names its namespaces dm<its pid>n<i>, the veths dm<pid>h<i>
    cut = time.monotonic()
    _ip("-n", f"{ns}n1", "link", "set", f"{ns}h1", "down")
    rc = proc.wait(timeout=TIMEOUT_S * 4 + 30)
    cleared = time.monotonic() - cut
    logs = _logs(tmp_path)
    print(f"\nlink down at checkpoint step {step}: both nodes stopped {cleared:.1f} s later (timeout {TIMEOUT_S} s)")
    assert rc != 0 and cleared < TIMEOUT_S * 2 + 10, (rc, cleared)  # the timeout, the step in flight, teardown
    assert len(re.findall(r"rank [01] of 2: a collective failed", logs)) >= 2, logs[-3000:]
    latest = checkpoint.latest(out / "checkpoints")
    checkpoint.verify(latest)
    resumed = int(latest.name.split("-")[1])
    proc = _cluster(out, [f"train.max_steps={resumed + 10}", "train.resume=true"], tmp_path)  # a fresh link
    assert proc.wait(timeout=180) == 0, _logs(tmp_path)[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == resumed + 10


@needs_netns
def test_throttled_link_slows_training_but_loses_nothing(tmp_path):
    reference, throttled = tmp_path / "reference", tmp_path / "throttled"
    # 32-wide tokens: enough bytes per step that 1 mbit costs seconds, well above the noise of shared cores
    run = ["train.max_steps=24", "model.d_model=32"]
    assert _cluster(reference, run, tmp_path).wait(timeout=240) == 0, _logs(tmp_path)[-3000:]
    proc = _cluster(throttled, run, tmp_path)
    wait_for_checkpoint(throttled / "checkpoints", 10, [proc], timeout=180)
    ns = f"dm{proc.pid}"
    for i in (0, 1):  # both directions, 400 mbit -> 1 mbit, a small bucket: no burst carries a step
        subprocess.run(["tc", "-n", f"{ns}n{i}", "qdisc", "change", "dev", f"{ns}h{i}", "root", "tbf", "rate", "1mbit",
                        "burst", "8kb", "latency", "1s"], check=True)
    assert proc.wait(timeout=300) == 0, _logs(tmp_path)[-3000:]
    ref, got = (json.loads((d / "summary.json").read_text()) for d in (reference, throttled))
    print(f"\n24 steps: {ref['train_seconds']:.1f} s at 400 mbit, {got['train_seconds']:.1f} s throttled to 1 mbit")
    assert got["steps"] == ref["steps"] == 24 and got["skipped_steps"] == 0
    assert got["val_loss"] == ref["val_loss"] and got["val_acc"] == ref["val_acc"]  # the same run, only slower
    assert got["train_seconds"] > ref["train_seconds"]


def test_gloo_pair_closure_is_a_collective_failure():
    """A link cut while an exchange is in flight surfaces from gloo as a pair closed by its timeout (the
    metadata's all-to-all is waited for after the payload leaves): every rank reports it as a failed
    collective, not as an internal error."""
    from dist_moe.distributed.process_group import collective_failure

    error = RuntimeError("Application timeout caused pair closure")  # as the CLI printed it
    failure = collective_failure(error, 1, 2, 15.0)
    assert failure is not None and str(failure).startswith("rank 1 of 2: a collective failed"), failure
    assert collective_failure(RuntimeError("shape mismatch"), 1, 2, 15.0) is None
