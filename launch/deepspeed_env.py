"""The environment file a multi-node deepspeed launch exports on every node (launch/deepspeed.sh).

    deepspeed_env.py OUT

DeepSpeed's multi-node runners (pdsh, the default, and openmpi, slurm, ...) start the ranks of other nodes
with only the launcher's NCCL, PYTHON, UCX, MV2 and MLFLOW variables, plus the KEY=VALUE lines of its
environment file: ``$DS_ENV_FILE`` (default ``.deepspeed_env``) in the home folder, then in the current one,
a later line winning (deepspeed 0.19.8's launcher/runner.py). So OMP_NUM_THREADS and the DIST_MOE_* variables
the run needs on every node (DIST_MOE_TOPOLOGY, DIST_MOE_DATA, the rank line) would stay on the first node.

OUT gets those variables, then the user's own file entries, which win on a name both set: the script then
points DS_ENV_FILE at OUT (an absolute path, which DeepSpeed reads in place of its two). The user's files are
read, never written. Node-local paths of the launch scripts (the error folder, the output socket) are left
out: a remote rank prints its line itself, and pdsh brings it back.

A remote node's shell reads each value inside double quotes: one of ours holding ", $, ` or \\ would be
expanded there, so it is refused (one line, exit 2), as is a user's line that is not KEY=VALUE (DeepSpeed
would stop on it with a traceback). Only this standard library: ``placement`` would import torch, seconds
at every launch.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile

NAME = os.environ.get("DS_ENV_FILE", ".deepspeed_env")  # the user's, read before the script replaces it
# set by the launch scripts for this node's ranks only (lib.sh, supervise.py, emulate_cluster.sh)
NODE_LOCAL = ("DIST_MOE_ERROR_DIR", "DIST_MOE_ERROR_ECHO", "DIST_MOE_OUTPUT_SOCKET", "DIST_MOE_LAUNCHER_LOG",
              "DIST_MOE_SUPERVISOR_PID")
EXPANDED = re.compile(r'["$`\\\n]')  # what a double-quoted value means otherwise to a shell


def ours(environ) -> dict[str, str]:
    """OMP_NUM_THREADS and every DIST_MOE_* variable but the node-local ones."""
    keep = {k: v for k, v in environ.items()
            if k == "OMP_NUM_THREADS" or k.startswith("DIST_MOE_") and k not in NODE_LOCAL}
    for key, value in keep.items():
        bad = EXPANDED.search(value)
        if bad:
            raise ValueError(f"{key} holds {bad.group()!r}: the other nodes' shells would expand it when the "
                             "deepspeed launcher exports it there; set it without")
    return dict(sorted(keep.items()))


def users(name: str = NAME) -> dict[str, str]:
    """The entries of the user's environment files, as DeepSpeed reads them: the home folder's, then the
    current folder's; blank lines skipped."""
    entries: dict[str, str] = {}
    for folder in (os.path.expanduser("~"), "."):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                key, sep, value = line.partition("=")
                if not sep or not key.strip():
                    raise ValueError(f"{os.path.abspath(path)} line {number} is not KEY=VALUE, the only lines the "
                                     "deepspeed launcher reads there")
                entries[key.strip()] = value.strip()
    return entries


def write_new(path: str, text: str) -> None:
    """``path`` replaced atomically by a fresh file (O_EXCL: never through a planted link), 0600."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".deepspeed_env.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: deepspeed_env.py OUT", file=sys.stderr)
        return 2
    try:
        entries = {**ours(os.environ), **users()}
        write_new(argv[0], "".join(f"{k}={v}\n" for k, v in entries.items()))
    except (ValueError, OSError) as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
