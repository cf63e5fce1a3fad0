"""Run an experiment's grid (skipping finished runs), then write its tables and plot.

    .venv/bin/python -m experiments.run routers|specdrop|gar|throughput [--seeds 0,1,2] [--tables-only]

Rows accumulate in experiments/results/<name>.jsonl; tables go to docs/results/<name>.md,
the plot to docs/results/<name>.png, and docs/RESULTS.md's block for <name> is replaced.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments import plans, tables

ROOT = Path(__file__).resolve().parent.parent


def done_ids(results: Path) -> set:
    if not results.exists():
        return set()
    return {json.loads(line)["id"] for line in results.read_text().splitlines() if line.strip()}



def launch(plan: plans.Plan, pending: list, results: Path) -> None:
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
    elif plan.launch == "ranks4":
        env["DIST_MOE_TOPOLOGY"] = "node=2,gpu=2"  # 4 ranks on loopback, accounted as 2 nodes x 2
        cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "-m", "experiments.worker", f.name]
    else:  # emulated: 2 network-namespace nodes x 2 ranks, throttled link (launch/emulate_cluster.sh)
        cmd = ["bash", str(ROOT / "launch/emulate_cluster.sh"), "--nodes", "2", "--procs-per-node", "2",
               "--rate", plan.rate, "--", "-m", "experiments.worker", f.name]
    try:
        subprocess.run(cmd, env=env, cwd=ROOT, check=True)
    finally:
        os.unlink(f.name)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(plans.PLANS))
    ap.add_argument("--seeds", help="comma-separated seeds (default: the experiment's)")
    ap.add_argument("--tables-only", action="store_true", help="only rebuild tables and plot from the results")
    args = ap.parse_args(argv)
    kwargs = {"seeds": [int(s) for s in args.seeds.split(",")]} if args.seeds else {}
    plan = plans.PLANS[args.name](**kwargs)
    results = ROOT / "experiments/results" / f"{args.name}.jsonl"
    results.parent.mkdir(parents=True, exist_ok=True)
    if not args.tables_only:
        done = done_ids(results)
        pending = [r for r in plan.runs if r["id"] not in done]
        print(f"{args.name}: {len(plan.runs) - len(pending)} of {len(plan.runs)} runs already in {results}; "
              f"running {len(pending)}", flush=True)
        if pending:
            launch(plan, pending, results)
    tables.write(args.name, results, ROOT / "docs")


if __name__ == "__main__":
    main()
