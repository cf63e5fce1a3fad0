"""launch/torchrun.sh, launch/deepspeed.sh and emulate_cluster.sh --launcher deepspeed run dist-moe training;
a failure ends with the first rank's line alone; a stopped rank ends the run within the timeout, a killed one
with exit 1; Ctrl-C prints one line; a kill -9 of the script leaves no rank running; bad options are one line and
exit 2; nothing is left in TMPDIR."""
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist_moe import errors
from dist_moe.distributed.rank_line import ASKED, rank_line, say_rank_line
from tests.faults.launch import descendants, wait_gone
from tests.support.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--quiet", "data.max_rows=2000", "train.epochs=2", "train.batch_size=64"]
FOREVER = ["--quiet", "data.max_rows=300", "train.max_steps=1000000", "train.log_every=1"]
DIST_MOE = str(Path(sys.executable).parent / "dist-moe")


def _env(tmp_path):
    tmp = tmp_path / "tmp dir"  # a space: every path the scripts build must stay one argument
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "DIST_MOE_DATA": str(tmp_path / "data"), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "VIRTUAL_ENV": sys.prefix}
    # the scripts run this interpreter's environment, on one node unless a test names more (torchrun.sh reads
    # a scheduler's NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT)
    for name in ("WORLD_SIZE", "CONDA_PREFIX", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _left_in_tmp(tmp_path) -> list[str]:
    """What the scripts left in TMPDIR (their run folders, torchrun's error-file folders), as relative paths."""
    tmp = tmp_path / "tmp dir"
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*")
                  if p.relative_to(tmp).parts[0].startswith(("dist-moe-launch", "torchelastic_")))


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
    assert _left_in_tmp(tmp_path) == []
    said = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert said == [f"rank {r}/2: torch {torch.__version__}, device cpu, backend gloo" for r in (0, 1)], proc.stdout


def test_deepspeed_script_runs_the_deepspeed_engine(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    proc = subprocess.run([str(ROOT / "launch/deepspeed.sh"), "--num_gpus", "2", "--master_port", str(free_port()),
                           "--", *SMALL, f"output.dir={out}"], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=240)
    s = _summary(proc, out)
    assert s["engine"] == "deepspeed" and s["world_size"] == 2


def test_deepspeed_no_ssh_nodes_on_the_emulated_cluster(tmp_path):
    """Also: a TMPDIR with a space (the generated hostfile's path) stays one argument (it was split)."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    cmd = [str(ROOT / "launch/emulate_cluster.sh"), "--nodes", "2", "--procs-per-node", "1", "--port",
           str(free_port()), "--launcher", "deepspeed", DIST_MOE, "train", *SMALL, "engine=deepspeed",
           f"output.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
    s = _summary(proc, out)
    # each node started its own launcher (--no_ssh --node_rank i); the topology came from its variables
    assert s["engine"] == "deepspeed" and s["world_size"] == 2 and s["topology"] == "node=2,gpu=1"
    assert _left_in_tmp(tmp_path) == []


def _pdsh_launch(tmp_path, **environ) -> tuple[subprocess.CompletedProcess, str]:
    """launch/deepspeed.sh from node 0 over a hostfile of two hosts, run in tmp_path/work, with a pdsh that records
    the command it was given (what runs on every node) instead of reaching them. Returns the run and that command."""
    pytest.importorskip("deepspeed")
    fake = tmp_path / "fake"
    fake.mkdir(exist_ok=True)
    (fake / "pdsh").write_text('#!/bin/sh\nprintf "%s\\n" "$@" >"$PDSH_ARGV"\n')
    (fake / "pdsh").chmod(0o755)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "hosts").write_text("node-a slots=1\nnode-b slots=1\n")
    env = {**_env(tmp_path), "HOME": str(tmp_path / "home"), "PDSH_ARGV": str(tmp_path / "pdsh-argv"), **environ}
    env["PATH"] = f"{fake}:{env['PATH']}"
    proc = subprocess.run([str(ROOT / "launch/deepspeed.sh"), "--hostfile", "hosts", "--no_ssh_check",
                           "--master_addr", "127.0.0.1", "--", "--quiet"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=120)
    argv = tmp_path / "pdsh-argv"
    return proc, argv.read_text() if argv.exists() else ""


def test_a_deepspeed_launch_from_node_0_exports_the_runs_variables_to_every_node(tmp_path):
    """DeepSpeed's pdsh runner forwards NCCL/PYTHON/UCX/MV2 variables and its environment file's lines only:
    OMP_NUM_THREADS and DIST_MOE_* reach the other nodes through this run's file, the user's own entries (in ~ and
    in the current folder, the latter winning) kept and winning over the run's, their files untouched; the error
    folder, a path on node 0, is not sent. Before: none of them reached another node."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / ".deepspeed_env").write_text("FROM_HOME=1\nSHARED=home\n")
    (work / ".deepspeed_env").write_text("SHARED=work\n\nOMP_NUM_THREADS=4\n")
    before = {p: p.read_bytes() for p in (home / ".deepspeed_env", work / ".deepspeed_env")}
    proc, command = _pdsh_launch(tmp_path, DIST_MOE_TOPOLOGY="node=2,gpu=1", DIST_MOE_DATA=str(tmp_path / "da ta"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    exports = dict(re.findall(r"export ([^=\s]+)=(\S+|\"[^\"]*\");", command))
    assert exports["DIST_MOE_TOPOLOGY"] == "node=2,gpu=1" and exports["DIST_MOE_RANK_LINE"] == "1"
    assert exports["DIST_MOE_DATA"] == f'"{tmp_path / "da ta"}"'  # DeepSpeed quotes it for the remote shell
    assert exports["OMP_NUM_THREADS"] == "4" and exports["SHARED"] == "work" and exports["FROM_HOME"] == "1"
    assert "DIST_MOE_ERROR_DIR" not in exports, command
    assert {p: p.read_bytes() for p in before} == before
    assert _left_in_tmp(tmp_path) == []


def test_a_deepspeed_env_value_another_nodes_shell_would_expand_is_refused(tmp_path):
    proc, command = _pdsh_launch(tmp_path, DIST_MOE_DATA="/data/$USER")
    assert proc.returncode == 2 and command == "", proc.stderr[-3000:]
    assert proc.stderr.splitlines() == ["deepspeed.sh: DIST_MOE_DATA holds '$': the other nodes' shells would expand "
                                        "it when the deepspeed launcher exports it there; set it without"]
    assert _left_in_tmp(tmp_path) == []
    (tmp_path / "work" / ".deepspeed_env").write_text("NOT A LINE\n")  # DeepSpeed would stop with a traceback
    proc, _ = _pdsh_launch(tmp_path)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"deepspeed.sh: {tmp_path / 'work' / '.deepspeed_env'} line 1 is not KEY=VALUE, the only lines the deepspeed "
        "launcher reads there"], proc.stderr[-3000:]


BAD_OPTIONS = [
    (["emulate_cluster.sh", "--launcher", "mpirun", "x.py"], "--launcher takes torchrun or deepspeed, got 'mpirun'"),
    (["torchrun.sh", "--nproc", "two"], "positive integer, got 'two'"),
    (["torchrun.sh", "--nproc", "0"], "positive integer, got '0'"),
    (["torchrun.sh", "--port", "99999"], "--port takes a port number in 1..65535, got '99999'"),
    (["torchrun.sh", "--port", "29577 --max-restarts 2"], "got '29577 --max-restarts 2'"),
    (["torchrun.sh", "--nproc"], "--nproc needs a value"),
    (["torchrun.sh", "--nnodes", "0"], "--nnodes takes a positive integer, got '0'"),
    (["torchrun.sh", "--nnodes", "2", "--master-addr", "h"], "--nnodes 2 needs --node-rank (or NODE_RANK)"),
    (["torchrun.sh", "--nnodes", "2", "--node-rank", "0"], "--nnodes 2 needs --master-addr (or MASTER_ADDR)"),
    (["torchrun.sh", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h"],
     "--node-rank takes a node rank in 0..1, got '2'"),
    (["torchrun.sh", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h --max-restarts 2"],
     "--master-addr takes a host name or address, got 'h --max-restarts 2'"),
    (["torchrun.sh", "--node-rank", "1"], "--node-rank 1 with one node: the only node rank is 0"),
    (["torchrun.sh", "--master-addr"], "--master-addr needs a value"),
    (["emulate_cluster.sh", "--port", "99999", "x.py"], "--port takes a port number in 1..65535, got '99999'"),
    (["emulate_cluster.sh", "--port", "29577 --max-restarts 2", "x.py"], "got '29577 --max-restarts 2'"),
    (["emulate_cluster.sh", "--rate", "bogus", "x.py"],
     "--rate takes a rate such as 400mbit, 1gbit or 50mbps, got 'bogus'"),
    (["emulate_cluster.sh", "--rate", "0mbit", "x.py"], "got '0mbit'"),
    (["deepspeed.sh", "--master_port", "99999", "--", "x=1"], "--master_port takes a port number in 1..65535"),
    (["deepspeed.sh", "--master_port=0", "--", "x=1"], "got '0'"),
    (["deepspeed.sh", "--hostfile", "no/such/hosts", "--", "x=1"], "--hostfile 'no/such/hosts': no such file"),
    (["deepspeed.sh", "--hostfile=no/such/hosts", "--", "x=1"], "--hostfile 'no/such/hosts': no such file"),
]


@pytest.mark.parametrize("args, message", BAD_OPTIONS, ids=[" ".join(a[:3]) for a, _ in BAD_OPTIONS])
def test_a_bad_launcher_option_is_one_line_and_exit_2(tmp_path, args, message):
    """Refused before anything starts (before: --port 99999 was passed on and ignored, --rate bogus exited 1
    with tc's text, a missing hostfile trained one local process and exited 0)."""
    proc = subprocess.run([str(ROOT / "launch" / args[0]), *args[1:]], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{args[0]}: ") and message in lines[0], proc.stderr[-2000:]
    assert proc.stdout == ""
    assert _left_in_tmp(tmp_path) == []


FAILING = {
    "torchrun.sh": ["torchrun.sh", "--nproc", "2", "--port", "PORT", "data.name=nope"],
    "deepspeed.sh": ["deepspeed.sh", "--num_gpus", "1", "--master_port", "PORT", "--", "data.name=nope"],
    "emulate_cluster.sh": ["emulate_cluster.sh", "--nodes", "2", "--procs-per-node", "1", "--port", "PORT",
                           DIST_MOE, "train", "data.name=nope"],
}


@pytest.mark.parametrize("script", FAILING)
def test_a_failure_prints_the_first_ranks_line_alone(tmp_path, script):
    """No launcher report (torchrun's ChildFailedError traceback, the deepspeed launcher's ERROR lines),
    no second rank's line: one line, then the rank's code (2 for a bad config; torchrun says 1 for any
    failure). Only the emulated cluster's node logs, named at the start, are kept."""
    if script == "deepspeed.sh":
        pytest.importorskip("deepspeed")
    args = [str(free_port()) if a == "PORT" else a for a in FAILING[script]]
    proc = subprocess.run([str(ROOT / "launch" / args[0]), *args[1:]], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    ours = [line for line in said if "dist-moe: error" in line]
    assert ours == [said[-1]] and ours[0].startswith("dist-moe: error: data.name must be one of"), proc.stderr[-3000:]
    # what else there is on stderr is the ranks' own (torch's c10d warnings), never the launcher's
    launchers = [line for line in said + proc.stdout.splitlines() if "Traceback" in line or "FAILED" in line
                 or "torch/distributed/elastic" in line or "launch.py" in line or "runner.py" in line]
    assert not launchers, launchers
    if script == "emulate_cluster.sh":
        assert "node<i>.log (kept if the run fails)" in said[0]
        kept = _left_in_tmp(tmp_path)
        assert len(kept) == 2 and kept[1] == f"{kept[0]}/node1.log", kept  # the run's folder holds that log only
        log = (tmp_path / "tmp dir" / kept[1]).read_text()
        assert "dist-moe: error (rank 1): data.name must be one of" in log  # node 1's own rank line
    else:
        assert _left_in_tmp(tmp_path) == []


def _start_forever(tmp_path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """launch/torchrun.sh training for good, in a session of its own (as a terminal's job), once both ranks
    have logged a step."""
    out = tmp_path / "run"
    proc = subprocess.Popen([str(ROOT / "launch/torchrun.sh"), "--nproc", "2", "--port", str(free_port()), *FOREVER,
                             f"output.dir={out}", *extra], cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 150
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.3)
    return proc, out


def test_ctrl_c_under_torchrun_sh_prints_one_line(tmp_path):
    """SIGINT to the script's process group, as a terminal's Ctrl-C sends it: the ranks stop and the run ends
    with one `interrupted` line naming the checkpoint train.resume=true continues from, and exit 130. A
    checkpoint every step: the Ctrl-C mostly lands in a save, which DCP wraps (its traceback, 190 lines,
    was printed instead). Before: 36-86 lines (torchrun's warnings, SignalException tracebacks, every
    rank's line, then the line again)."""
    proc, out = _start_forever(tmp_path, "train.checkpoint_every=1")
    tree = descendants(proc.pid)
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    print(f"\nCtrl-C: the script exited {time.monotonic() - start:.1f} s later")
    assert proc.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    # the lowest rank that wrote its line before torchrun stopped the rest
    assert len(lines) == 1 and re.fullmatch(rf"dist-moe: error( \(rank 1\))?: interrupted; train\.resume=true "
                                            rf"continues from {re.escape(str(out))}/checkpoints/step-\d+",
                                            lines[0]), err[-3000:]
    assert wait_gone(tree, 30) == []
    assert _left_in_tmp(tmp_path) == []


def test_kill_9_of_torchrun_sh_stops_its_ranks(tmp_path):
    """bash cannot trap SIGKILL: supervise.py (the script's child) gets SIGTERM when the script dies and
    stops torchrun, and every rank gets SIGKILL when torchrun dies (launch/rank.py). Before: torchrun and
    both ranks went on training, orphaned."""
    proc, out = _start_forever(tmp_path)
    tree = descendants(proc.pid)
    ranks = [p for p in tree if _cmdline(p)[1:3] == ["-u", DIST_MOE]]
    assert len(ranks) == 2, [_cmdline(p) for p in tree]
    start = time.monotonic()
    proc.kill()  # the script alone
    proc.wait()
    left = wait_gone(tree, 30)
    print(f"\nkill -9 of torchrun.sh: its {len(tree)} processes were gone {time.monotonic() - start:.1f} s later")
    for pid in left:  # do not leave them training over the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"still running after the script's kill -9: {left}"
    rows = (out / "metrics.jsonl").read_text().count("\n")
    time.sleep(1)
    assert (out / "metrics.jsonl").read_text().count("\n") == rows
    deadline = time.monotonic() + 30
    while _left_in_tmp(tmp_path) and time.monotonic() < deadline:  # the watcher removes the run's folder
        time.sleep(0.2)
    assert _left_in_tmp(tmp_path) == []


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace").split("\0")
    except OSError:
        return []


def _rank_pids(pid: int, rank: int) -> list[int]:
    """The process of global rank ``rank`` below ``pid``: launch/rank.py as the launcher started it, or the
    `dist-moe train` it became (the same process)."""
    found = []
    for p in descendants(pid):
        try:
            environ = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and _cmdline(p)[1:3] in (["-u", str(ROOT / "launch/rank.py")],
                                                                      ["-u", DIST_MOE]):
            found.append(p)
    return found


STOP_TIMEOUT_S = 6


def test_a_stopped_rank_ends_the_torchrun_sh_run_with_the_timeout_line(tmp_path):
    """kill -STOP of rank 1: rank 0's collective times out and its own line ends the run a few seconds after
    parallel.timeout_s. A stopped process acts on no signal but SIGKILL and SIGCONT (supervise.py continues
    one that has its launcher's SIGTERM pending): otherwise torchrun's SIGTERM waits for its own SIGKILL 30 s
    later, and that SIGKILL is named as the cause."""
    proc, _ = _start_forever(tmp_path, f"parallel.timeout_s={STOP_TIMEOUT_S}")
    tree = descendants(proc.pid)
    rank1 = _rank_pids(proc.pid, 1)
    assert len(rank1) == 1, [_cmdline(p) for p in tree]
    start = time.monotonic()
    os.kill(rank1[0], signal.SIGSTOP)
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    took = time.monotonic() - start
    print(f"\nkill -STOP of rank 1: torchrun.sh exited {took:.1f} s later (timeout {STOP_TIMEOUT_S} s)")
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, (proc.returncode, err[-3000:])
    assert lines[0].startswith("dist-moe: error: rank 0 of 2: a collective failed") and \
        f"parallel.timeout_s={STOP_TIMEOUT_S} s" in lines[0], lines[0]
    assert took < STOP_TIMEOUT_S + 10, took  # the timeout and the teardown, not torchrun's 30 s more
    assert wait_gone(tree, 10) == []
    assert _left_in_tmp(tmp_path) == []


KILLED = {
    "torchrun.sh": ["torchrun.sh", "--nproc", "2", "--port", "PORT"],
    "deepspeed.sh": ["deepspeed.sh", "--num_gpus", "2", "--master_port", "PORT", "--"],
}


@pytest.mark.parametrize("script", KILLED)
def test_a_rank_killed_by_a_signal_exits_1_under_every_script(tmp_path, script):
    """kill -9 of rank 1 as it starts: one line naming it, and exit 1, as for any failed run (the deepspeed
    launcher's own code is the rank's, 247 for a SIGKILL; emulate_cluster.sh --launcher deepspeed goes through
    the same supervise.py)."""
    if script == "deepspeed.sh":
        pytest.importorskip("deepspeed")
    args = [str(free_port()) if a == "PORT" else a for a in KILLED[script]]
    proc = subprocess.Popen([str(ROOT / "launch" / args[0]), *args[1:], *FOREVER, f"output.dir={tmp_path / 'run'}"],
                            cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (rank1 := _rank_pids(proc.pid, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.05)
        tree = descendants(proc.pid)
        os.kill(rank1[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    said = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 1, (proc.returncode, err[-3000:])
    assert len(said) == 1 and re.match(r"dist-moe: error: (local )?rank 1 was killed by SIGKILL; the other ranks "
                                       r"were stopped", said[0]), err[-3000:]
    assert wait_gone(tree, 10) == []


class _Writes(io.RawIOBase):
    """A raw stream that records each write() it gets."""

    def __init__(self):
        self.writes = []

    def writable(self):
        return True

    def write(self, b):
        self.writes.append(bytes(b))
        return len(b)


def test_an_error_line_is_one_write(monkeypatch):
    """Under `python -u` (torchrun and deepspeed run ranks so) stderr writes through at once: print()
    wrote the line and its newline apart, and two ranks' lines could meet on one line."""
    raw = _Writes()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8", write_through=True))
    for name in ("DIST_MOE_ERROR_DIR", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    assert errors.report(ValueError("bad value 'x'")) == 2
    assert raw.writes == [b"dist-moe: error (rank 1): bad value 'x'\n"]


def test_a_rank_killed_by_a_signal_is_named_from_the_launchers_report():
    """supervise.py reads torchrun's failure report (formatted here by torch's own ChildFailedError) and the
    deepspeed launcher's exit lines: a rank killed by SIGKILL (the OOM killer) is the line shown, ahead of
    the other ranks' "a collective failed"; the SIGTERM torchrun sends the others is not a cause."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    sys.path.insert(0, str(ROOT / "launch"))
    try:
        import supervise
    finally:
        sys.path.remove(str(ROOT / "launch"))
    failures = {0: ProcessFailure(0, 101, -signal.SIGTERM, "<N/A>"), 2: ProcessFailure(0, 103, 3, "<N/A>"),
                1: ProcessFailure(1, 102, -signal.SIGKILL, "<N/A>")}
    report = str(ChildFailedError("dist-moe", failures))
    assert supervise.failed_ranks(report) == (["rank 1 was killed by SIGKILL"], ["rank 2 exited with code 3"])
    deepspeed = ("[2026-12-02 05:12:03,463] [ERROR] [launch.py:259:sigkill_handler] ['python', '-u', 'rank.py', "
                 "'--local_rank=1', 'train'] exits with return code = -11")
    assert supervise.failed_ranks(deepspeed) == (["local rank 1 was killed by SIGSEGV"], [])


def _executable(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


def _project_tool(home: Path, name: str, **env) -> subprocess.CompletedProcess:
    """lib.sh's project_tool NAME, lib.sh copied into home/launch (home is then the project's folder)."""
    (home / "launch").mkdir(exist_ok=True)
    shutil.copy(ROOT / "launch/lib.sh", home / "launch/lib.sh")
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
    return subprocess.run(["bash", "-c", '. "$LIB" && project_tool "$1"', "launcher.sh", name],
                          env={**base, "LIB": str(home / "launch/lib.sh"), **env}, capture_output=True, text=True)


def test_the_scripts_take_the_active_environment_then_venv_then_python3(tmp_path):
    """A CPU .venv must not win over an activated environment (a GPU image's CUDA torch)."""
    home, venv, conda = tmp_path / "project", tmp_path / "venv", tmp_path / "conda"
    active, base = _executable(venv / "bin/python"), _executable(conda / "bin/python")
    project = _executable(home / ".venv/bin/python")
    _executable(home / ".venv/bin/dist-moe")
    on_path = _executable(tmp_path / "path/python3")
    chosen = [_project_tool(home, "python", VIRTUAL_ENV=str(venv), CONDA_PREFIX=str(conda)),  # a venv over conda's
              _project_tool(home, "python", CONDA_PREFIX=str(conda)),
              _project_tool(home, "python")]
    assert [(p.returncode, p.stdout.strip()) for p in chosen] == [(0, active), (0, base), (0, project)]
    shutil.rmtree(home / ".venv")
    no_venv = _project_tool(home, "python", PATH=f"{tmp_path / 'path'}:/usr/bin:/bin")
    assert (no_venv.returncode, no_venv.stdout.strip()) == (0, on_path)
    # an active environment without the tool is named, never mixed with .venv's
    _executable(home / ".venv/bin/dist-moe")
    missing = _project_tool(home, "dist-moe", VIRTUAL_ENV=str(venv))
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.splitlines() == [f"launcher.sh: the active environment {venv} has no dist-moe: install "
                                           "dist-moe there (pip install -e .), or deactivate it"]


def test_the_rank_line_names_the_torch_build_device_and_backend(monkeypatch, capsys):
    gpu = rank_line(1, 4, "2.11.0+cu128", torch.device("cuda", 1), "nccl", "NVIDIA H200")
    assert gpu == "rank 1/4: torch 2.11.0+cu128, device cuda:1 (NVIDIA H200), backend nccl"
    monkeypatch.delenv(ASKED, raising=False)
    say_rank_line(0, 1, torch.device("cpu"), None)  # a plain `dist-moe train`: nothing
    assert capsys.readouterr().out == ""
    monkeypatch.setenv(ASKED, "1")
    say_rank_line(0, 1, torch.device("cpu"), None)
    assert capsys.readouterr().out == f"rank 0/1: torch {torch.__version__}, device cpu, backend none (one process)\n"
