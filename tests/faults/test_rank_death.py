"""A rank killed mid-step, and a process killed mid-checkpoint: the others stop with a clear
error within the collective timeout, and the last complete checkpoint resumes."""
import json
import os
import signal
import subprocess
import sys
import time

from dist_moe.train.checkpoint import store as checkpoint
from tests.faults.launch import ROOT, start_ranks, summary, wait_all, wait_for_checkpoint

TIMEOUT_S = 20
RUN = ["data.max_rows=3000", "train.batch_size=32", "router.num_experts=8", "router.top_k=2",
       "train.checkpoint_every=10", f"parallel.timeout_s={TIMEOUT_S}", "train.log_every=5"]


def test_sigkill_mid_step_stops_every_rank_and_the_checkpoint_resumes(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    env = {"DIST_MOE_DATA": str(tmp_path / "data")}
    procs = start_ranks(2, [*RUN, "train.max_steps=100000"], out, env)
    step = wait_for_checkpoint(out / "checkpoints", 20, procs)
    killed_at = time.monotonic()
    os.kill(procs[1].pid, signal.SIGKILL)
    codes = wait_all(procs, TIMEOUT_S + 30)
    cleared = time.monotonic() - killed_at
    log = (out / "rank0.log").read_text()
    assert codes[0] == 1 and codes[1] == -signal.SIGKILL, codes  # a runtime failure: exit 1
    assert "a collective failed" in log and "train.resume=true" in log, log[-2000:]
    last = log.strip().splitlines()[-1]
    assert "Traceback" not in log and last.startswith("dist-moe: error: rank 0 of 2"), log[-2000:]
    print(f"\nrank 0 stopped {cleared:.2f} s after rank 1 was killed (timeout {TIMEOUT_S} s)")
    assert cleared < TIMEOUT_S + 15, cleared
    latest = checkpoint.latest(out / "checkpoints")
    checkpoint.verify(latest)  # intact: every file as its manifest says
    resumed_from = int(latest.name.split("-")[1])
    assert resumed_from >= step
    procs = start_ranks(2, [*RUN, f"train.max_steps={resumed_from + 10}", "train.resume=true"], out, env)
    assert wait_all(procs, 120) == [0, 0], (out / "rank0.log").read_text()[-2000:]
    s = summary(out)
    assert s["steps"] == resumed_from + 10 and s["skipped_steps"] == 0
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1] == resumed_from + 10


KILL_IN_SAVE = """
import os, signal, sys
from dist_moe.train.checkpoint import store as checkpoint
real = checkpoint.write_manifest
def dying(path, *rest):
    if path.name == ".tmp-step-20":  # DCP has written every file; the rename has not happened
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, *rest)
checkpoint.write_manifest = dying
from dist_moe.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigkill_during_checkpoint_save_keeps_the_previous_one(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DIST_MOE_DATA": str(tmp_path / "data")}
    args = ["train", "--quiet", f"output.dir={out}", *RUN, "train.max_steps=30"]
    done = subprocess.run([sys.executable, "-c", KILL_IN_SAVE, *args], env=env, cwd=ROOT, timeout=120)
    assert done.returncode == -signal.SIGKILL
    ckpts = out / "checkpoints"
    assert (ckpts / ".tmp-step-20").is_dir()  # the partial save is there ...
    assert checkpoint.latest(ckpts).name == "step-10"  # ... and never picked up
    checkpoint.verify(ckpts / "step-10")
    done = subprocess.run([sys.executable, "-m", "dist_moe.cli", *args, "train.resume=true"], env=env, cwd=ROOT,
                          timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert summary(out)["steps"] == 30 and checkpoint.latest(ckpts).name == "step-30"
    assert not (ckpts / ".tmp-step-20").exists()  # the next save at that step cleared it
    # steps 15 and 20 were logged before the kill and trained again: each is in the log once
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert logged == sorted(set(logged)) and logged[-1] == 30, logged
