"""The commands README.md and the docs pages show, run as written from the repository root, in page order.

    .venv/bin/python -m tests.support.doc_commands            # every command but the templates and the set-up commands
    .venv/bin/python -m tests.support.doc_commands --list     # what it would run, and what it leaves out and why

A command is a line of a fenced block that starts with ``.venv/bin/``, ``launch/``, ``make``, ``torchrun`` or
``deepspeed`` (a ``NAME=value`` prefix allowed; a line ending in a backslash goes on). Left out: templates for hosts
this machine is not (a ``$VARIABLE`` or a hostfile), a placeholder (``NAME``), and ``make demo`` / ``make test``,
which CI runs. A command shown on two pages runs once. Each command prints its exit code and seconds; the script
exits 1 if one failed, or took over 20 s without its comment saying how long. Run it in a fresh clone after
``make demo``: commands write their runs and plots where the pages say (all ignored by git), and ``experiments.run``
rewrites its tables from the committed rows, so ``git status`` shows a table that does not reproduce."""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/getting-started.md", "docs/cli.md", "docs/running.md", "docs/concepts.md",
         "docs/expert-parallelism.md", "docs/configuration.md", "docs/engines.md", "docs/deepspeed.md",
         "docs/megatron.md", "docs/transformers.md", "docs/gpu-clusters.md", "docs/measured.md", "docs/RESULTS.md",
         "docs/RELIABILITY.md", "docs/layout.md", "benchmarks/README.md")
STARTS = re.compile(r"^(?:[A-Z_]+=\S+ )*(?:\.venv/bin/|launch/\S+\.sh|make |torchrun |deepspeed )")
SET_UP = ("make demo", "make test")
SLOW_S = 20  # a command that takes longer must say how long in its comment, e.g. "# ... (about 40 s)"
TIMED = re.compile(r"\b\d+(?:\.\d+)?(?:-\d+)? ?(?:s|min|minutes|hours?)\b")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str
    comment: str = ""  # the trailing "  # ..." comments of its lines

    @property
    def says_its_time(self) -> bool:
        return bool(TIMED.search(self.comment))

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

    @property
    def train_args(self) -> list[str] | None:
        """The arguments ``dist-moe train`` gets from this command (launch/deepspeed.sh's ``engine=deepspeed``
        included), or None for a command that trains nothing: what a test checks a template's config with."""
        try:
            words = shlex.split(self.text)
        except ValueError:  # unbalanced quotes: no command line a test could read
            return None
        if not words:
            return None
        if words[0] == "launch/deepspeed.sh" and "--" in words:
            return [*words[words.index("--") + 1:], "engine=deepspeed"]
        if words[0] == "launch/torchrun.sh":
            rest = words[1:]
            while rest and rest[0] in TORCHRUN_SH_OPTIONS:
                rest = rest[2:]
            return rest
        found = [i for i, w in enumerate(words[:-1]) if w.rstrip(")").endswith("dist-moe") and words[i + 1] == "train"]
        return words[found[0] + 2:] if found else None


# launch/torchrun.sh's own options (each with a value), before the training's arguments
TORCHRUN_SH_OPTIONS = ("--nproc", "--port", "--nnodes", "--node-rank", "--master-addr")


def commands(pages=PAGES) -> list[Command]:
    found = []
    for page in pages:
        fenced, pending, start, comment = False, "", 0, ""
        for n, line in enumerate((ROOT / page).read_text().splitlines(), 1):
            if line.startswith("```"):
                fenced, pending = not fenced, ""
                continue
            if not fenced:
                continue
            text, _, said = line.partition("  #")  # a trailing comment says what it does
            text = text.strip()
            if not pending and not STARTS.match(text):
                continue
            if not pending:
                start, comment = n, ""
            pending, comment = f"{pending} {text}".strip(), f"{comment} {said}".strip()
            if pending.endswith("\\"):
                pending = pending[:-1].strip()
                continue
            found.append(Command(page, start, pending, comment))
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
        took = time.monotonic() - start
        print(f"exit {code}  {took:6.1f} s  {where}  {cmd.text}", flush=True)
        if code != 0:
            failed.append(where)
            print(f"    {tail[0] if tail else ''}", flush=True)
        elif took > SLOW_S and not cmd.says_its_time:
            failed.append(where)
            print(f"    took {took:.0f} s, and the page does not say how long: add it to the command's comment "
                  f"(# ... (about {took:.0f} s))", flush=True)
    if failed:
        print(f"{len(failed)} failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
