"""BRANCH's balanced subtree limit, old rule against new, on the routers cells and a drifting one.

Trains each cell of the routers experiment (``experiments/plans.py``: E=16 top-4, capacity 1.25,
240 steps, ``router.subtree_limit=1``, tree-prefix placement, node dedup) with each balance
variant, 4 ranks as 2 nodes x 2, and prints per cell (data set x node map x variant) the
validation loss, node-share CV, busiest rank / mean rank and dropped slots (evaluation routing,
EMA anchors), the same balance of the training batches (routed with each batch's statistic, mean
over the last third of the steps), mean +- spread (half the range) over the seeds. Variants:

- ``sign``: DeepSeek-V3's sign rule at rate 1e-2, evaluation routed with the training bias (the
  balance as first chosen: ``balance_rule=sign balance_rate=0.01 balance_eval=false``);
- ``newton``: the default (``balance_rule=newton``, its default rate, ``balance_eval=true``).

The ``sorted`` cells train on the training set sorted by class (one fixed order every epoch, so
the batches drift from class to class) and also train switch and deepseek_v3 there as the flat
references; the other cells' flat references are the rows of ``experiments/results/routers.jsonl``
(the same overrides and seeds). ``--lm`` adds the tiny LM (configs/lm_branch.yaml, E=8 top-2, 200
steps), flat references from ``experiments/results/lm_routers.jsonl``.

    .venv/bin/python benchmarks/balance.py [--seeds 0,1,2] [--lm] [--out /tmp/balance.jsonl]

Rows already in ``--out`` are not trained again (a stopped run resumes); ``--table`` only prints.
Each rank runs with OMP_NUM_THREADS=1. All 60 runs (3 seeds, with ``--lm``) took 2016 s on 2 shared
CPU cores, about 30 s a tabular run and 70 s an LM run; the table is in benchmarks/README.md
("Balance on data the router never saw").
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CELL = ["router.num_experts=16", "router.top_k=4", "model.capacity_factor=1.25", "model.expert_type=swiglu",
        "model.ffn_hidden_size=32", "parallel.dedup=node", "train.max_steps=240", "train.batch_size=64",
        "train.lr=0.003", "train.log_every=40"]
MAPS = {"linear": ["router.node_map=linear"], "mlp4": ["router.node_map=mlp", "router.mlp_hidden=4"]}
VARIANTS = {"sign": ["router.balance_rule=sign", "router.balance_rate=0.01", "router.balance_eval=false"],
            "newton": ["router.balance_rule=newton"]}
LIMIT = ["router.type=branch", "router.subtree_limit=1", "router.subtree_balance=bias",
         "parallel.placement=tree_prefix"]
FLAT = {"switch": ["router.type=switch"], "deepseek_v3": ["router.type=deepseek_v3"]}
DATASETS = ("magic", "letter", "satimage")
SORTED = ("magic",)  # the drifting cell: per epoch (60 steps) 39 steps of one class, 21 of the other


def plan(seeds, lm: bool) -> list[dict]:
    """Seed-major, so that a run cut short still has whole cells at its first seeds."""
    runs = []
    for seed in seeds:
        for data in DATASETS + tuple(f"{d}-sorted" for d in SORTED):
            name = data.split("-")[0]
            for m, map_keys in MAPS.items():
                for v, keys in VARIANTS.items():
                    runs.append(_run(f"{data}-{m}-{v}-s{seed}", data, m, v, seed,
                                     [f"data.name={name}", *CELL, *LIMIT, *map_keys, *keys]))
            if data.endswith("sorted"):
                for arm, keys in FLAT.items():
                    runs.append(_run(f"{data}-{arm}-s{seed}", data, "flat", arm, seed,
                                     [f"data.name={name}", *CELL, *keys, "parallel.placement=contiguous"]))
        if lm:
            for v, keys in VARIANTS.items():
                runs.append({**_run(f"lm-linear-{v}-s{seed}", "lm", "linear", v, seed,
                                    [*LIMIT, "router.node_map=linear", *keys, "parallel.dedup=node",
                                     "train.max_steps=200", "data.per_domain=500", "train.log_every=50"]),
                             "config": "configs/lm_branch.yaml"})
    return runs


def _run(run_id, data, node_map, variant, seed, overrides) -> dict:
    return {"id": run_id, "data": data, "map": node_map, "variant": variant, "seed": seed, "config": None,
            "overrides": [f"seed={seed}", *overrides, f"output.dir=/tmp/dist_moe_balance/{run_id}",
                          "output.overwrite=true"]}


# --- on every rank, under torchrun


def _sorted_by_class(data, seed: int) -> None:
    """The training rows in class order (shuffled inside each class): a distribution that drifts."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(data.y_train), generator=g)
    order = order[torch.sort(data.y_train[order], stable=True).indices]
    object.__setattr__(data, "x_train", data.x_train[order])
    object.__setattr__(data, "y_train", data.y_train[order])


def _record_training_loads(model) -> None:
    """Each router keeps its training forwards' hard loads (its own rows; summed over ranks later)."""
    from dist_moe.moe.view import moe_layers

    def hook(router, _inputs, routing):
        if router.updates_state:
            router.balance_loads.append(routing.stats["load"].detach().double().cpu())

    for layer in moe_layers(model):
        layer.router.balance_loads = []
        layer.router.register_forward_hook(hook)


def _patch_trainer(run: dict) -> None:
    """The trainer builds data and model through these names: a run may sort its data and records loads."""
    from dist_moe.train import build, trainer
    from dist_moe.train.checkpoint import state as training_state

    def data_and_model(cfg, rt):
        data, model = build.data_and_model(cfg, rt)
        if run["data"].endswith("sorted"):
            _sorted_by_class(data, run["seed"])
        _record_training_loads(model)
        return data, model

    class InOrder(training_state.DataCursor):  # the stored order every epoch
        def next_batch(self):
            if self._perm is None:
                self._epoch_start, self._perm = self.gen.get_state(), torch.arange(self.n)
            return super().next_batch()

    trainer.data_and_model = data_and_model
    trainer.DataCursor = InOrder if run["data"].endswith("sorted") else training_state.DataCursor


def training_balance(model, data, rt) -> dict:
    """Node-share CV and busiest rank / mean of the training batches, mean over the last third of the
    steps and over the MoE layers (every rank's loads summed, as the dispatch sees them)."""
    from dist_moe.moe.view import moe_layers
    from placement import busiest, node_share

    cvs, ranks = [], []
    for layer in moe_layers(model):
        loads = rt.sum(torch.stack(layer.router.balance_loads))
        for load in loads[-max(len(loads) // 3, 1):]:
            cvs.append(node_share(load, layer.expert_node)[1])
            ranks.append(busiest(load, layer.expert_rank))
    return {"train_node_share_cv": sum(cvs) / len(cvs), "train_busiest_rank": sum(ranks) / len(ranks)}


def worker(plan_path: str) -> None:
    from dist_moe.distributed.process_group import init_from_env, shutdown
    from dist_moe.train.config import load_config
    from dist_moe.train.trainer import train

    spec = json.loads(Path(plan_path).read_text())
    rank, world, _ = init_from_env()
    for run in spec["runs"]:
        _patch_trainer(run)
        cfg = load_config(run["config"], run["overrides"])
        start = time.time()
        summary = train(cfg, quiet=True, after=training_balance)
        if rank == 0:
            row = {k: v for k, v in run.items() if k != "overrides"}
            row.update({"wall_s": round(time.time() - start, 1), **{k: summary.get(k) for k in KEYS}})
            with open(spec["out"], "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"[{run['id']}] loss {row['val_loss']:.4f}, node CV {row['val_node_share_cv']}, "
                  f"{row['wall_s']} s", flush=True)
    shutdown()


KEYS = ("val_loss", "val_node_share_cv", "val_busiest_rank", "val_dropped_fraction", "train_node_share_cv",
        "train_busiest_rank")


# --- the driver


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _reference_rows(seeds) -> list[dict]:
    """The flat routers of the unsorted cells and of the LM, as the experiments recorded them."""
    out = []
    for name, prefix in (("routers", ""), ("lm_routers", "lm-")):
        for row in _rows(ROOT / "experiments" / "results" / f"{name}.jsonl"):
            data = "lm" if prefix else row.get("dataset")
            if row.get("arm") in FLAT and row.get("seed") in seeds and (prefix or data in DATASETS):
                out.append({"data": data, "map": "flat", "variant": row["arm"], "seed": row["seed"],
                            **{k: row.get(k) for k in KEYS}})
    return out


def _stat(values, fmt: str) -> str:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return "—"
    mean = sum(values) / len(values)
    return f"{mean:{fmt}} ± {(max(values) - min(values)) / 2:{fmt}}" if len(values) > 1 else f"{mean:{fmt}}"


def table(rows: list[dict]) -> str:
    cells = {}
    for row in rows:
        cells.setdefault((row["data"], row["map"], row["variant"]), []).append(row)
    lines = ["| data | map | variant | seeds | val loss | val node CV | val busiest | val dropped | "
             "train node CV | train busiest |", "|---|---|---|---|---|---|---|---|---|---|"]
    order = [*DATASETS, *(f"{d}-sorted" for d in SORTED), "lm"]
    for key in sorted(cells, key=lambda k: (order.index(k[0]), k[1] == "flat", k[1], k[2])):
        rs = cells[key]
        drop = [r["val_dropped_fraction"] * 100 if r["val_dropped_fraction"] is not None else None for r in rs]
        lines.append(f"| {' | '.join(key)} | {len(rs)} | {_stat([r['val_loss'] for r in rs], '.4f')} | "
                     f"{_stat([r['val_node_share_cv'] for r in rs], '.3f')} | "
                     f"{_stat([r['val_busiest_rank'] for r in rs], '.2f')}x | {_stat(drop, '.1f')}% | "
                     f"{_stat([r.get('train_node_share_cv') for r in rs], '.3f')} | "
                     f"{_stat([r.get('train_busiest_rank') for r in rs], '.2f')}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--lm", action="store_true", help="add the tiny LM's cells")
    ap.add_argument("--only", default="", help="comma-separated run-id prefixes to keep (default: all)")
    ap.add_argument("--out", default="/tmp/dist_moe_balance.jsonl")
    ap.add_argument("--table", action="store_true", help="print the table of --out without training")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    done = {r["id"] for r in _rows(out)}
    keep = tuple(p for p in args.only.split(",") if p)
    todo = [r for r in plan(seeds, args.lm) if r["id"] not in done and (not keep or r["id"].startswith(keep))]
    if todo and not args.table:
        spec = Path(f"{out}.plan.json")
        spec.write_text(json.dumps({"out": str(out), "runs": todo}))
        env = {**os.environ, "DIST_MOE_TOPOLOGY": "node=2,gpu=2", "OMP_NUM_THREADS": "1"}
        start = time.time()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                        __file__, "--worker", str(spec)], cwd=ROOT, env=env, check=True)
        print(f"{len(todo)} runs in {time.time() - start:.0f} s", flush=True)
    rows = [r for r in _rows(out) if r["seed"] in seeds] + _reference_rows(seeds)
    print(table(rows))


if __name__ == "__main__":
    main()
