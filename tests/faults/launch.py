"""Start `dist-moe train` as N independent rank processes (as N nodes' launchers would), so a
test can kill one, cut its network or corrupt its files and watch what the others do."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]


def start_ranks(world: int, overrides: list[str], out: Path, env_extra: dict | None = None,
                port: int | None = None, code: dict[int, str] | None = None) -> list[subprocess.Popen]:
    """``code``: a rank's program in place of the CLI (``python -c``, given the CLI's arguments), for a
    test that makes one rank misbehave at a chosen point."""
    port = port or free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "PYTHONPATH": str(ROOT), **(env_extra or {})}
        log = (out / f"rank{rank}.log").open("w")
        program = ["-c", code[rank]] if code and rank in code else ["-m", "dist_moe.cli"]
        procs.append(subprocess.Popen([sys.executable, *program, "train", "--quiet",
                                       f"output.dir={out}", *overrides], env=env, cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def wait_for_checkpoint(ckpt_dir: Path, min_step: int, procs, timeout: float = 120.0) -> int:
    """The step of ``latest`` once it reaches ``min_step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pointer = ckpt_dir / "latest"
        if pointer.exists():
            step = int(pointer.read_text().strip().split("-")[1])
            if step >= min_step:
                return step
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a rank exited before step {min_step}: {[p.poll() for p in procs]}")
        time.sleep(0.2)
    raise TimeoutError(f"no checkpoint at step >= {min_step} within {timeout} s")


def wait_all(procs, timeout: float) -> list[int]:
    """Exit codes; ranks still running after ``timeout`` are killed and reported as None."""
    deadline = time.monotonic() + timeout
    codes = [None] * len(procs)
    while time.monotonic() < deadline and any(c is None for c in codes):
        codes = [p.poll() for p in procs]
        time.sleep(0.1)
    for p, c in zip(procs, codes):
        if c is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return codes


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def alive(pid: int) -> bool:
    """Running (a zombie or a pid gone from /proc is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (children of children, whatever session they started)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def wait_gone(pids, timeout: float) -> list[int]:
    """The pids still running after ``timeout`` s (a hang fails fast instead of hanging the suite)."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
