"""Train a plan's runs one after another inside one launched process group.

    python -m experiments.worker PLAN.json       (under torchrun or launch/emulate_cluster.sh)

The plan names a results file (JSONL); rank 0 appends one row per finished run
(the trainer's summary plus the experiment's measurements), so a plan that dies
half-way loses only the run in flight: the driver skips rows already there.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from dist_moe.distributed.process_group import init_from_env, shutdown
from dist_moe.train.config import load_config
from dist_moe.train.trainer import train
from experiments import measures


def run_plan(plan: dict) -> None:
    rank, world, _ = init_from_env()
    results = Path(plan["results"])
    if plan.get("before"):
        row = getattr(measures, plan["before"])()
        if rank == 0:
            with results.open("a") as f:
                f.write(json.dumps({"id": f"{plan['before']}-{time.strftime('%Y%m%dT%H%M%S')}",
                                    "date": time.strftime("%Y-%m-%d"), **row}) + "\n")
    for run in plan["runs"]:
        cfg = load_config(run.get("config"), run["overrides"])
        torch.manual_seed(cfg.seed)
        start = time.time()
        after = getattr(measures, plan["after"]) if plan.get("after") else None
        summary = train(cfg, quiet=True, after=after)
        if rank == 0:
            post = getattr(measures, plan["post"])(summary, cfg) if plan.get("post") else {}
            row = {"id": run["id"], **run["labels"], "world": world, "wall_s": round(time.time() - start, 2),
                   "date": time.strftime("%Y-%m-%d"), **summary, **post}
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"[{run['id']}] {row.get('val_loss', float('nan')):.4f} loss, {row['wall_s']} s", flush=True)
    shutdown()


if __name__ == "__main__":
    run_plan(json.loads(Path(sys.argv[1]).read_text()))
