"""One rank of a launch script's run: torchrun and the deepspeed launcher start this file in place
of SCRIPT; it ties the rank's life to its launcher, gives it the script's own stdout and stderr,
then becomes ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) as the launcher would have run it.

    python -u launch/rank.py [--local_rank=N] SCRIPT|-m MODULE [ARGS...]

- The rank gets SIGKILL when its launcher dies (Linux's parent-death signal, kept across exec): a
  launcher killed with -9 leaves no rank training. torchrun starts each rank in a session of its own,
  so only this reaches them.
- launch/supervise.py sends the launcher's own output (torchrun's log lines and tracebacks) to a log
  file; a rank whose stdout or stderr is that file takes the script's back from supervise.py (file
  descriptors over a unix socket), so ranks write where they would without a launcher.
"""
import ctypes
import os
import signal
import socket
import sys

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: no parent-death signal, no subreaper
        return False


def die_with_parent(sig: int, parent: int) -> bool:
    """Get ``sig`` when ``parent`` (this process's parent) ends; False if it has ended already."""
    prctl(PR_SET_PDEATHSIG, int(sig))
    return os.getppid() == parent  # checked after prctl: a parent that died just before is seen here


def unix_address(path: str) -> tuple[str, int]:
    """An address for the unix socket at ``path`` short enough for bind/connect (108 bytes; pytest's and
    other deep TMPDIRs exceed it): the socket's name under /proc/self/fd/<its folder>; and that fd."""
    folder, name = os.path.split(path)
    fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY)
    return (f"/proc/self/fd/{fd}/{name}" if os.path.isdir("/proc/self/fd") else path), fd


def take_script_output(sock_path: str, captured_path: str) -> None:
    """Point stdout and stderr, where they are the launcher's captured output, back at the script's."""
    try:
        captured = os.stat(captured_path)
        address, folder_fd = unix_address(sock_path)
    except OSError:
        return
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(address)
            _, fds, _, _ = socket.recv_fds(s, 16, 2)
    except OSError:
        return  # supervise.py is gone: the run is ending
    finally:
        os.close(folder_fd)
    for target, fd in zip((1, 2), fds):
        st = os.fstat(target)
        if (st.st_dev, st.st_ino) == (captured.st_dev, captured.st_ino):  # not a launcher's own per-rank log
            os.dup2(fd, target)
        os.close(fd)


def script_command(argv: list[str]) -> list[str]:
    """``python -u SCRIPT ARGS`` (both launchers run their ranks unbuffered); the deepspeed launcher's
    ``--local_rank=N``, which it puts before SCRIPT (here this file), goes back after SCRIPT or
    ``-m MODULE``, where that launcher would have put it."""
    local_rank = [argv.pop(0)] if argv and argv[0].startswith("--local_rank=") else []
    head = 2 if argv[:1] == ["-m"] else 1
    return [sys.executable, "-u", *argv[:head], *local_rank, *argv[head:]]


def main(argv: list[str]) -> None:
    if not argv or argv == ["-m"]:
        sys.exit("launch/rank.py: no SCRIPT given")
    supervisor = int(os.environ.pop("DIST_MOE_SUPERVISOR_PID", "0") or 0)
    parent = os.getppid()
    # supervise.py is a subreaper: a rank whose launcher died before it got here is its child now
    if not die_with_parent(signal.SIGKILL, parent) or parent in (1, supervisor):
        sys.exit(1)
    sock, captured = os.environ.pop("DIST_MOE_OUTPUT_SOCKET", ""), os.environ.pop("DIST_MOE_LAUNCHER_LOG", "")
    if sock and captured:
        take_script_output(sock, captured)
    cmd = script_command(argv)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
