"""Collectives per MoE layer forward + backward, by dedup mode and pipeline chunks.

4 gloo ranks as 2 nodes x 2; BRANCH E=16 top-4 with subtree_limit 1 (its default balance) on
tree-prefix placement, 256 tokens per rank,
one training forward and backward of the expert-parallel MoELayer. Every torch.distributed
collective a rank issues is counted (all-to-alls apart); the counts are the same on every rank
(a rank that differs is reported). On the emulated 400 mbit link each costs ~2.4 ms of latency
(benchmarks/README.md), so the count is part of a pipelined layer's time.

    .venv/bin/python benchmarks/collectives.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_moe import MoELayer
from placement import Placement, Topology
from tests.support.dist_utils import run_workers  # noqa: E402

ROUTER = {"type": "branch", "num_experts": 16, "top_k": 4, "subtree_limit": 1}  # the node level
CASES = [(dedup, chunks) for dedup in ("none", "rank", "node") for chunks in (1, 4)]
COUNTED = ("all_to_all_single", "all_to_all", "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
           "barrier", "reduce_scatter_tensor", "all_gather_object")


def count_collectives(run) -> dict:
    """{collective name: calls} while ``run()`` runs, from torch.distributed's module functions (what
    the dispatcher calls)."""
    counts = {}
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counting(name, fn):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    try:
        run()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return counts


def worker(rank, world, out_path):
    topology = Topology(("node", "gpu"), (2, 2))
    rows = []
    for dedup, chunks in CASES:
        torch.manual_seed(0)
        layer = MoELayer(32, 16, ROUTER, placement=Placement.tree_prefix(
            16, topology), topology=topology, group=dist.group.WORLD, dedup=dedup, pipeline_chunks=chunks)
        x = torch.randn(256, 32, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        layer(x)  # warm-up: node groups are created on the first forward's path

        def step():
            y, aux = layer(x)
            (y.square().mean() + aux).backward()

        fwd = count_collectives(lambda: layer(x))
        both = count_collectives(step)
        rows.append((dedup, chunks, fwd, both))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        lines = ["| dedup | chunks | all-to-alls forward | backward | other collectives (fwd + bwd) "
                 "| same on every rank |",
                 "|---|---|---|---|---|---|"]
        for i, (dedup, chunks, fwd, both) in enumerate(rows):
            a2a_f = fwd.get("all_to_all_single", 0)
            a2a_b = both.get("all_to_all_single", 0) - a2a_f
            other = {k: v for k, v in both.items() if k != "all_to_all_single"}
            same = all(r[i] == rows[i] for r in gathered)
            lines.append(f"| {dedup} | {chunks} | {a2a_f} | {a2a_b} | {other or '—'} | {'yes' if same else 'NO'} |")
        Path(out_path).write_text("\n".join(lines) + "\n")


def main() -> None:
    out = Path("/tmp/dist_moe_collectives.md")
    run_workers(worker, 4, args=(str(out),), timeout=600)
    print(__doc__.split("\n\n")[0])
    print(out.read_text())


if __name__ == "__main__":
    main()
