"""Run an experiment's grid (skipping finished runs), then write its tables and plot.

    .venv/bin/python -m experiments.run routers|lm_routers|specdrop|gar|gar_ep|throughput|throughput_link|ep_layouts
                                        [--seeds 0,1,2] [--tables-only] [--results FILE] [--out DIR]

Rows accumulate in experiments/results/<name>.jsonl (the committed results: runs already there
are skipped, so on a fresh clone nothing runs); tables go to docs/results/<name>.md, the plot
to docs/results/<name>.png, and docs/RESULTS.md's block for <name> is replaced. To run it all
again, give a results file of your own (``--results /tmp/routers.jsonl``) and a folder for
its tables (``--out /tmp/docs``). Ctrl-C or kill stop the launched ranks (and the emulated
cluster's namespaces) before this command exits.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments import plans, tables

ROOT = Path(__file__).resolve().parent.parent


def done_ids(results: Path) -> set:
    if not results.exists():
        return set()
    return {json.loads(line)["id"] for line in results.read_text().splitlines() if line.strip()}


def launch(plan: plans.Plan, pending: list, results: Path, ranks: int = 4) -> None:
    body = {"results": str(results), "after": plan.after, "post": plan.post, "before": plan.before,
            "runs": pending}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(body, f)
    # the emulated nodes start the first `python` on PATH: make it this one
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    py = sys.executable
    if plan.launch == "single":
        cmd = [py, "-m", "experiments.worker", f.name]
    elif plan.launch == "ranks":  # on loopback, accounted as nodes of 2 (4 ranks: 2 nodes x 2)
        env["DIST_MOE_TOPOLOGY"] = f"node={max(1, ranks // 2)},gpu={min(2, ranks)}"
        cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "experiments.worker", f.name]
    else:  # emulated: 2 network-namespace nodes x 2 ranks, throttled link (launch/emulate_cluster.sh)
        cmd = ["bash", str(ROOT / "launch/emulate_cluster.sh"), "--nodes", "2", "--procs-per-node", "2",
               "--rate", plan.rate, "--", "-m", "experiments.worker", f.name]
    try:
        code = run_forwarding(cmd, env, ROOT)
    finally:
        os.unlink(f.name)
    if code:
        raise SystemExit(f"{plan.name}: the launched runs failed (exit {code}); finished runs are kept in {results}")


def run_forwarding(cmd: list[str], env: dict, cwd, grace_s: float = 30.0) -> int:
    """Run a launcher in a session of its own and pass SIGINT/SIGTERM on to it as SIGTERM, then wait:
    torchrun stops its workers, emulate_cluster.sh its nodes and namespaces, before this process
    exits (subprocess.run would SIGKILL the launcher on Ctrl-C and leave them behind). A launcher
    still running ``grace_s`` after the signal is killed with its process group."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True)
    stopped = []

    def forward(signum, frame):
        stopped.append((signum, time.monotonic()))
        os.killpg(proc.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                code = proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if stopped and time.monotonic() - stopped[0][1] > grace_s:
                    os.killpg(proc.pid, signal.SIGKILL)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopped:
        print(f"stopped by signal {stopped[0][0]}; the launched ranks have exited", file=sys.stderr)
        raise SystemExit(128 + stopped[0][0])  # the shell's convention: 130 after Ctrl-C
    return code


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(plans.PLANS))
    ap.add_argument("--seeds", help="comma-separated seeds (default: the experiment's)")
    ap.add_argument("--tables-only", action="store_true", help="only rebuild tables and plot from the results")
    ap.add_argument("--results", type=Path, help="results file (default: the committed experiments/results/NAME.jsonl)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs", help="folder for RESULTS.md, tables and plots")
    args = ap.parse_args(argv)
    kwargs = {"seeds": [int(s) for s in args.seeds.split(",")]} if args.seeds else {}
    plan = plans.PLANS[args.name](**kwargs)
    results = (args.results or ROOT / "experiments/results" / f"{args.name}.jsonl").resolve()
    results.parent.mkdir(parents=True, exist_ok=True)
    if not args.tables_only:
        done = done_ids(results)
        pending = [r for r in plan.runs if r["id"] not in done]
        print(f"{args.name}: {len(plan.runs) - len(pending)} of {len(plan.runs)} runs already in {results}; "
              f"running {len(pending)}", flush=True)
        if pending and plan.launch == "ranks":  # one launch per rank count the runs name
            for ranks in sorted({r["ranks"] for r in pending}):
                launch(plan, [r for r in pending if r["ranks"] == ranks], results, ranks)
        elif pending:
            launch(plan, pending, results)
    tables.write(args.name, results, args.out)


if __name__ == "__main__":
    main()
