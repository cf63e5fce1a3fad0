"""Keeps a launcher (torchrun, the deepspeed launcher) for a launch script (lib.sh), and the watcher
that cleans up after a script killed with -9.

    supervise.py --parent PID --dir DIR [--passthrough] -- LAUNCHER [ARGS...]
    supervise.py --watch PID --remove DIR [-- CLEANUP...]

Keeping a launcher:
- nothing outlives the script: this process gets SIGTERM when the script (PID) dies, even by kill -9,
  and stops the launcher; the launcher gets SIGKILL if this process dies, and each rank (launch/rank.py)
  SIGKILL if its launcher dies. This process is a subreaper: what the launcher orphans comes here, and
  the launcher's process group is killed once it has exited (the deepspeed launcher's per-node launch.py).
- the first SIGINT / SIGTERM / SIGHUP goes on to the launcher's process group (a terminal's Ctrl-C
  reaches the script and this process, not the launcher's own session: it is sent on once); a launcher
  still running GRACE_S later is killed.
- a rank stopped with kill -STOP (or a debugger's job control) acts on no signal but SIGKILL and SIGCONT:
  the SIGTERM a launcher sends the other ranks once one has failed (or the signal passed on above) would
  wait there for the launcher's own SIGKILL, 30 s on (torchrun's shutdown timeout, the deepspeed launcher's
  wait), and that SIGKILL would be reported as the run's cause. A process of the launcher's tree that is
  stopped with such a signal pending is sent SIGCONT, so it acts on it at once.
- the launcher's own output (torchrun's log lines and its ChildFailedError or SignalException
  tracebacks, the deepspeed launcher's INFO lines) goes to DIR/launcher-<pid>.log; the ranks take this
  process's stdout and stderr back through DIR/launcher-<pid>.sock (launch/rank.py), so what a user sees
  is the ranks' output and, on failure, the line the script picks (lib.sh's first_error). A launcher
  that fails with no rank's line leaves a line naming its log, which is then kept. --passthrough: the
  launcher writes here directly (DeepSpeed's pdsh runs, whose ranks' output arrives through it).

The watcher (--watch) runs in a session of its own (Ctrl-C is for the run, not for its cleanup). When
PID ends it removes DIR and runs CLEANUP; SIGUSR1 (the script's own cleanup has run) dismisses it.
"""
import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from rank import PR_SET_CHILD_SUBREAPER, die_with_parent, prctl, unix_address

GRACE_S = 5.0
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
RESCAN_S = 5.0  # how often the launcher's process tree is read anew (all of /proc); its ranks start once


def serve_output(server: socket.socket) -> None:
    """Hand each rank that asks this process's stdout and stderr."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn, contextlib.suppress(OSError):
            socket.send_fds(conn, [b"out"], [1, 2])


def failed_ranks(text: str) -> tuple[list[str], list[str]]:
    """The ranks the launcher reports (torchrun's failure report: rank, then exitcode; the deepspeed
    launcher's ``[... '--local_rank=N' ...] exits with return code = C``): those killed by a signal it did
    not send itself (SIGKILL from the OOM killer, SIGSEGV), and those that exited non-zero."""
    found = [("rank " + r, int(c)) for r, c in re.findall(r"rank\s+: (\d+) \(local_rank.*?\n\s*exitcode\s+: (-?\d+)",
                                                          text)]
    found += [("local rank " + r, int(c)) for r, c in
              re.findall(r"--local_rank=(\d+).*exits with return code = (-?\d+)", text)]
    killed, exited = [], []
    for who, c in dict(found).items():
        if c < 0 and -c in signal.valid_signals() and -c not in (signal.SIGTERM, signal.SIGINT):
            killed.append(f"{who} was killed by {signal.Signals(-c).name}")
        elif c > 0:
            exited.append(f"{who} exited with code {c}")
    return killed, exited


def last_words(text: str) -> str:
    """The launcher's last line that says something (not torchrun's ==== rules), shortened."""
    said = [" ".join(line.split()) for line in text.splitlines()[-300:] if line.strip(" =-")]
    return repr(said[-1][:300]) if said else "no output"


def write_record(folder: str, code: int, line: str, keep: str = "", kind: str = "launcher") -> None:
    """A line for lib.sh's first_error in ``<kind><pid>.err``: ``code time_ns``, the line, a log to keep."""
    try:
        if not folder:
            return
        fd = os.open(Path(folder, f"{kind}{os.getpid()}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                     0o600)
    except OSError:
        return  # no script to read it (the watcher removed the folder after a kill -9)
    with os.fdopen(fd, "w") as f:
        f.write(f"{code} {time.time_ns()}\n{line}\n{keep}\n")


def process_tree(pid: int) -> list[int]:
    """Every process below ``pid`` now (none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):  # gone meanwhile
                    ppid = int(Path("/proc", name, "stat").read_bytes().rsplit(b")", 1)[1].split()[1])
                    children.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def continue_stopped(pids: list[int]) -> None:
    """SIGCONT each of ``pids`` that is stopped with SIGINT, SIGTERM or SIGHUP pending (see the module's doc)."""
    for pid in pids:
        try:
            status = Path("/proc", str(pid), "status").read_text()
        except OSError:
            continue  # it has exited
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        pending = int(fields.get("ShdPnd", "0"), 16) | int(fields.get("SigPnd", "0"), 16)
        if fields.get("State", "").split()[:1] == ["T"] and any(pending >> (s - 1) & 1 for s in STOPS):
            with contextlib.suppress(ProcessLookupError, PermissionError):  # gone, its pid taken meanwhile
                os.kill(pid, signal.SIGCONT)


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# one pass, each branch one case it handles (complexity above the lint's 15, kept whole)
def keep_launcher(parent: int, folder: Path, passthrough: bool, cmd: list[str]) -> int:  # noqa: C901
    if not die_with_parent(signal.SIGTERM, parent):
        return 1  # the script is gone already
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    me, env, out, server = os.getpid(), dict(os.environ), None, None
    log = folder / f"launcher-{me}.log"
    if not passthrough:
        sock_path = str(folder / f"launcher-{me}.sock")
        address, folder_fd = unix_address(sock_path)
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen(64)
        os.close(folder_fd)
        out = open(log, "ab")  # noqa: SIM115  the launcher's log, open for the supervisor's whole life
        env.update(DIST_MOE_SUPERVISOR_PID=str(me), DIST_MOE_OUTPUT_SOCKET=sock_path, DIST_MOE_LAUNCHER_LOG=str(log))

    def tie_to_me():  # in the launcher, before exec (no thread is running yet)
        if not die_with_parent(signal.SIGKILL, me):
            os._exit(1)

    launcher = subprocess.Popen(cmd, env=env, stdout=out, stderr=out, start_new_session=True, preexec_fn=tie_to_me)
    stopped = []

    def stop(sig, frame):
        if not stopped:
            stopped.append((sig, time.monotonic()))
            with contextlib.suppress(ProcessLookupError):  # a hang-up stops as a kill does (the deepspeed
                os.killpg(launcher.pid, signal.SIGTERM if sig == signal.SIGHUP else sig)  # launcher: INT, TERM only)

    for sig in STOPS:
        signal.signal(sig, stop)
    if server:
        threading.Thread(target=serve_output, args=(server,), daemon=True).start()
    tree, scanned = [], float("-inf")
    while True:
        try:
            status = launcher.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            if stopped and time.monotonic() - stopped[0][1] > GRACE_S:
                kill_group(launcher.pid)  # its ranks follow (rank.py)
            if time.monotonic() - scanned > RESCAN_S:
                tree, scanned = process_tree(launcher.pid), time.monotonic()
            continue_stopped(tree)
    kill_group(launcher.pid)  # whatever of its process group is left (the deepspeed launcher's launch.py)
    code = status if status >= 0 else 128 - status
    if stopped:
        sig = stopped[0][0]
        code = 128 + sig
        write_record(os.environ.get("DIST_MOE_ERROR_DIR", ""), code,
                     "dist-moe: error: interrupted" if sig == signal.SIGINT
                     else f"dist-moe: error: stopped by {signal.Signals(sig).name}")
    elif status and not passthrough:
        name = "torchrun" if "torch.distributed.run" in cmd else Path(cmd[0]).name
        try:
            text = log.read_text(errors="replace")
        except OSError:
            text = ""  # the watcher removed the folder: the script is gone
        killed, exited = failed_ranks(text)
        if killed or exited:  # a failed run: 1, as torchrun says for any (the deepspeed launcher exits with
            code = 1  # the failed rank's return code, 247 for a SIGKILL)
        folder = os.environ.get("DIST_MOE_ERROR_DIR", "")
        if killed:  # the cause of the other ranks' "a collective failed": shown before their lines
            write_record(folder, code, f"dist-moe: error: {', '.join(killed)}; the other ranks were stopped "
                         f"({name}'s report is kept in {log})", keep=str(log), kind="killed")
        else:  # shown when no rank wrote a line
            what = ", ".join(exited) if exited else f"{name} failed (exit code {code}), ending with {last_words(text)}"
            write_record(folder, code, f"dist-moe: error: {what} without an error line ({name}'s output is kept "
                         f"in {log})", keep=str(log))
    return code


def watch(parent: int, folder: str, cleanup: list[str]) -> int:
    with contextlib.suppress(OSError):
        os.setsid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
    if die_with_parent(signal.SIGTERM, parent) and signal.sigwait({signal.SIGTERM, signal.SIGUSR1}) == signal.SIGUSR1:
        return 0
    shutil.rmtree(folder, ignore_errors=True)
    if cleanup:
        os.execvp(cleanup[0], cleanup)
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="launch/supervise.py")
    p.add_argument("--parent", type=int, help="the launch script's pid")
    p.add_argument("--dir", type=Path, help="the run's folder (launcher log, socket)")
    p.add_argument("--passthrough", action="store_true")
    p.add_argument("--watch", type=int, help="watch this pid, then clean up")
    p.add_argument("--remove", default="", help="with --watch: the folder to remove")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.watch:
        return watch(args.watch, args.remove, cmd)
    if not cmd or not args.parent or not args.dir:
        p.error("--parent, --dir and a launcher command are needed")
    return keep_launcher(args.parent, args.dir, args.passthrough, cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
