"""GAR step time over its baseline on the same model, in one process and over 2 gloo ranks, measured
side by side.

Both arms run the paper's task-batch construction: 5 tasks x 4 same-task groups
per update (20 observations, as in the paper's 1.04x measurement), one forward
and backward per group with gradient accumulation, one global clip, one Adam
step. The baseline stops there (GAR with lambda = 0 recovers it); GAR adds the
observations (per-group expert gradients, all-reduced over the EP group), the
router recomputation from detached inputs and the auxiliary backward. The two
arms alternate step by step, so drift on the machine hits both alike.

    .venv/bin/python benchmarks/gar_overhead.py [--steps 12] [--ranks 1,2] [--hidden 256] [--ffn 1024]
                                                [--experts lora]

Under expert parallelism the observations cost one all-reduce of [groups, d]
floats per layer (d: one expert's trainable parameters): large for full FFN
experts, small for LoRA adapters.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist

from dist_moe.models import MoERegressor
from dist_moe.moe.view import moe_views
from dist_moe.train.step.gar_step import equal_task_weights, gar_train_step, rank_local_param_ids
from dist_moe.train.step.grads import sum_replicated_grads
from tests.support.dist_utils import run_workers  # noqa: E402


def worker(rank, world, args, out_path):
    torch.set_num_threads(1)
    H = args.hidden

    torch.manual_seed(0)
    router = {"type": "switch", "num_experts": 8, "top_k": 2, "jitter_eps": 0.0}
    model = MoERegressor(32, H, args.ffn, router, group=dist.group.WORLD, dedup="rank", expert_type=args.experts)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    groups, tasks = [], []
    for t in range(5):
        w = torch.randn(32, generator=g)
        for _ in range(4):
            x = torch.randn(args.group_size, args.seq_len, 32, generator=g).squeeze(1) + t
            groups.append((x, x @ w))
            tasks.append(t)
    weights = equal_task_weights(tasks, [args.group_size] * len(groups))
    sizes = [args.group_size] * len(groups)

    def loss_fn(m, grp):
        pred, aux = m(grp[0])
        return ((pred - grp[1]) ** 2).mean() + aux

    def baseline_step():
        opt.zero_grad(set_to_none=True)
        share = 1.0 / world
        for grp, w in zip(groups, weights):
            (share * w * loss_fn(model, grp)).backward()
        # as GAR's step does
        sum_replicated_grads(list(model.parameters()), rank_local_param_ids(moe_views(model)), dist.group.WORLD)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def gar_step():
        gar_train_step(model, groups, loss_fn, opt, weights, lam=1e-3, max_grad_norm=1.0, sizes=sizes)

    times = {"baseline": [], "gar": []}
    for step in range(args.steps + 2):
        for name, fn in (("baseline", baseline_step), ("gar", gar_step)):
            dist.barrier()
            start = time.perf_counter()
            fn()
            t = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if step >= 2:  # two warm-up steps
                times[name].append(float(t))
    if rank == 0:
        torch.save(times, out_path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ranks", default="1,2", help="comma-separated rank counts, measured one after the other")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--group-size", type=int, default=8, help="examples per group (the paper's micro-batch: 8)")
    ap.add_argument("--seq-len", type=int, default=32, help="tokens per example (1: one-token examples)")
    ap.add_argument("--experts", choices=("swiglu", "lora"), default="swiglu",
                    help="lora: rank-8 adapters over a frozen base, the paper's LoRA-FFN setting")
    args = ap.parse_args()
    try:
        worlds = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        worlds = []
    if not worlds or any(w < 1 for w in worlds):
        ap.error(f"--ranks must be rank counts >= 1 separated by commas, got {args.ranks!r}")
    print(f"switch E=8 top-2, {args.experts} experts, hidden {args.hidden}, ffn {args.ffn}, 5 tasks x 4 groups "
          f"of {args.group_size} examples x {args.seq_len} tokens per rank per update, {args.steps} steps per arm "
          "(median), gloo:")
    print("  ranks   baseline ms   GAR ms   GAR / baseline")
    for world in worlds:
        out = Path("/tmp") / f"gar_overhead_{torch.randint(0, 10**9, (1,)).item()}.pt"
        run_workers(worker, world, args=(args, str(out)), timeout=900)
        times = torch.load(out, weights_only=True)
        out.unlink()
        base, gar = statistics.median(times["baseline"]), statistics.median(times["gar"])
        print(f"  {world:5d}   {1e3 * base:11.1f}   {1e3 * gar:6.1f}   {gar / base:.3f}x", flush=True)
    print("  (GAR: lambda 1e-3, materialized; the paper: 1.04x on its five-task DeBERTa mixture)")


if __name__ == "__main__":
    main()
