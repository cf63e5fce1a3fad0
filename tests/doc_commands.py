"""The commands README.md and the docs pages show, run as written from the repository root, in page order.

    .venv/bin/python -m tests.doc_commands            # every command but the templates and the set-up commands
    .venv/bin/python -m tests.doc_commands --list     # what it would run, and what it leaves out and why

A command is a line of a fenced block that starts with ``.venv/bin/``, ``launch/``, ``make``, ``torchrun`` or
``deepspeed`` (a ``NAME=value`` prefix allowed; a line ending in a backslash goes on). Left out: templates for
hosts this machine is not (a ``$VARIABLE`` or a hostfile), a placeholder (``NAME``), and ``make demo`` /
``make test``, which CI runs. A command shown on two pages runs once. Each command prints its exit code and
seconds; the script exits 1 if one failed. Run it in a fresh clone after ``make demo``: commands write their
runs and plots where the pages say (all ignored by git), and ``experiments.run`` rewrites its tables from the
committed rows, so ``git status`` shows a table that does not reproduce.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/getting-started.md", "docs/cli.md", "docs/running.md", "docs/transformers.md",
         "docs/expert-parallelism.md", "docs/deepspeed-and-megatron.md", "docs/gpu-clusters.md",
         "docs/measured.md", "docs/RESULTS.md", "benchmarks/README.md")
STARTS = re.compile(r"^(?:[A-Z_]+=\S+ )*(?:\.venv/bin/|launch/\S+\.sh|make |torchrun |deepspeed )")
SET_UP = ("make demo", "make test")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str

    @property
    def left_out(self) -> str | None:
        """Why the check does not run it, or None."""
        if self.text.startswith(SET_UP):
            return "a set-up command (CI runs it)"
        if "$" in self.text or "--hostfile" in self.text or "--nnodes" in self.text:
            return "a template for other hosts"
        if re.search(r"(?<![\w=/.-])[A-Z]{3,}(?![\w=])", self.text):
            return "a template (a placeholder in capitals)"
        return None


def commands(pages=PAGES) -> list[Command]:
    found = []
    for page in pages:
        fenced, pending, start = False, "", 0
        for n, line in enumerate((ROOT / page).read_text().splitlines(), 1):
            if line.startswith("```"):
                fenced, pending = not fenced, ""
                continue
            if not fenced:
                continue
            text = line.split("  #", 1)[0].strip()  # a trailing comment says what it does
            if not pending and not STARTS.match(text):
                continue
            if not pending:
                start = n
            pending = f"{pending} {text}".strip()
            if pending.endswith("\\"):
                pending = pending[:-1].strip()
                continue
            found.append(Command(page, start, pending))
            pending = ""
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="list the commands and what is left out, run nothing")
    ap.add_argument("--timeout", type=float, default=900, help="seconds each command may take (default 900)")
    args = ap.parse_args()
    failed, seen = [], set()
    for cmd in commands():
        where = f"{cmd.page}:{cmd.line}"
        if cmd.text in seen:  # shown on two pages: a second run would find the first's run directory
            continue
        seen.add(cmd.text)
        if cmd.left_out or args.list:
            print(f"{'left out: ' + cmd.left_out if cmd.left_out else 'would run'}  {where}  {cmd.text}", flush=True)
            continue
        start = time.monotonic()
        try:
            done = subprocess.run(["bash", "-c", cmd.text], cwd=ROOT, capture_output=True, text=True,
                                  timeout=args.timeout)
            code, tail = done.returncode, (done.stdout + done.stderr).strip().splitlines()[-1:]
        except subprocess.TimeoutExpired:
            code, tail = "timeout", []
        print(f"exit {code}  {time.monotonic() - start:6.1f} s  {where}  {cmd.text}", flush=True)
        if code != 0:
            failed.append(where)
            print(f"    {tail[0] if tail else ''}", flush=True)
    if failed:
        print(f"{len(failed)} failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
