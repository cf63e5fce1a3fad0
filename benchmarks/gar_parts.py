"""Where GAR's extra step time goes, one process: the profile behind benchmarks/gar_overhead.py's ratio.

The benchmark's shape: switch E=8 top-2 over SwiGLU experts (hidden 256, ffn 1024), 5 tasks x 4
same-task groups of 8 examples x 32 tokens per update. The baseline (grouped accumulation, clip,
Adam) and GAR's pieces (collection with its observation reads, L_norm, the auxiliary backward,
clip, Adam) are timed in the same loop, step by step, and their medians printed.

    .venv/bin/python benchmarks/gar_parts.py [--steps 10]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_moe.gar import observe
from dist_moe.models import MoERegressor
from dist_moe.train.step.gar_step import equal_task_weights, gar_objective


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MoERegressor(32, 256, 1024, {"type": "switch", "num_experts": 8, "top_k": 2, "jitter_eps": 0.0})
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    groups, tasks = [], []
    for t in range(5):
        w = torch.randn(32, generator=g)
        for _ in range(4):
            x = torch.randn(8, 32, 32, generator=g) + t
            groups.append((x, x @ w))
            tasks.append(t)
    weights = equal_task_weights(tasks, [8] * len(groups))

    def loss_fn(m, grp):
        pred, aux = m(grp[0])
        return ((pred - grp[1]) ** 2).mean() + aux

    reads = []  # the observation reads: each group's fresh expert gradients summed over experts, in their hooks
    adder = observe._adder

    def timed_adder(out, stacked):
        add = adder(out, stacked)

        def run(grad):
            start = time.perf_counter()
            add(grad)
            reads.append(time.perf_counter() - start)
        return run

    observe._adder = timed_adder

    def clip_and_step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    parts = {k: [] for k in ("baseline", "collection", "observation reads", "L_norm", "aux backward", "gar clip+step")}
    for step in range(args.steps + 2):
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        for grp, w in zip(groups, weights):
            (w * loss_fn(model, grp)).backward()
        clip_and_step()
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        reads.clear()
        t2 = time.perf_counter()
        obs = observe.collect_observations(model, groups, loss_fn, weights)
        t3 = time.perf_counter()
        aux = gar_objective(obs)
        t4 = time.perf_counter()
        (1e-3 * aux).backward()
        t5 = time.perf_counter()
        clip_and_step()
        t6 = time.perf_counter()
        if step >= 2:  # two warm-up steps
            for key, v in zip(parts, (t1 - t0, t3 - t2, sum(reads), t4 - t3, t5 - t4, t6 - t5)):
                parts[key].append(v)
    ms = {k: 1e3 * statistics.median(v) for k, v in parts.items()}
    gar = ms["collection"] + ms["L_norm"] + ms["aux backward"] + ms["gar clip+step"]
    print(f"one process, SwiGLU experts, 5 tasks x 4 groups x 8 examples x 32 tokens, {args.steps} steps (median):")
    for key, v in ms.items():
        print(f"  {key:18s} {v:8.1f} ms  ({100 * v / ms['baseline']:5.1f}% of the baseline)")
    print(f"  GAR / baseline = {gar / ms['baseline']:.3f}x")


if __name__ == "__main__":
    main()
