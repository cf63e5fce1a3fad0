"""Local experts' forward + backward: one grouped GEMM per projection against the per-expert loop, and
grouped in bf16 against the loop in fp32, measured side by side.

The fine-grained shape: hidden 512, expert ffn 128, 4,096 rows spread unevenly over the local experts
(E_local 8 and 32). Each repetition runs the three arms back to back in a rotating order, so drift on
the machine hits all alike; the ratios printed are medians of the repetitions' paired ratios, with
their spread (the lowest and highest pair) beside them.

    .venv/bin/python benchmarks/grouped_experts.py [--reps 15] [--experts 8,32] [--rows 4096]
                                                   [--hidden 512] [--ffn 128]

Goals: grouped <= 0.75x the loop in fp32, bf16 grouped <= 0.5x the fp32 loop.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_moe.moe.experts import Experts  # noqa: E402


def arms(experts: int, rows: int, hidden: int, ffn: int, seed: int = 0) -> dict:
    """name -> a function running one forward + backward of that arm."""
    gen = torch.Generator().manual_seed(seed)
    share = torch.rand(experts, generator=gen) + 0.2  # uneven, every expert holding some rows
    counts = (share / share.sum() * rows).long()
    counts[0] += rows - counts.sum()
    torch.manual_seed(seed)
    module = Experts(experts, hidden, ffn, "swiglu")
    x = torch.randn(rows, hidden, generator=gen)
    grad = torch.randn(rows, hidden, generator=gen)
    count_list, count_tensor = counts.tolist(), counts

    def run(forward, dtype):
        xi = x.to(dtype).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = forward(xi)
        y.backward(grad.to(y.dtype))
        module.zero_grad(set_to_none=True)

    return {
        "loop fp32": lambda: run(lambda xi: module._looped_forward(xi, count_list, None), torch.float32),
        "grouped fp32": lambda: run(lambda xi: module(xi, count_tensor), torch.float32),
        "grouped bf16": lambda: run(lambda xi: module(xi, count_tensor), torch.bfloat16),
    }


def measure(experts: int, args) -> dict:
    runs = arms(experts, args.rows, args.hidden, args.ffn)
    for fn in runs.values():  # warm-up: allocator, kernels' first use
        fn()
    times = {name: [] for name in runs}
    names = list(runs)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    loop = times["loop fp32"]
    out = {"loop fp32 ms": 1e3 * statistics.median(loop)}
    for name in ("grouped fp32", "grouped bf16"):
        ratios = [t / base for t, base in zip(times[name], loop)]
        out[name] = (statistics.median(ratios), min(ratios), max(ratios))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--experts", default="8,32", help="local expert counts, comma-separated")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=128)
    args = p.parse_args()
    print(f"swiglu experts, hidden {args.hidden}, ffn {args.ffn}, {args.rows} rows, forward + backward, "
          f"{torch.get_num_threads()} thread(s), {args.reps} interleaved repetitions; ratios to the fp32 loop "
          "(median of paired ratios [lowest, highest])")
    print(f"{'E_local':>8} {'loop fp32 ms':>13} {'grouped fp32':>24} {'grouped bf16':>24}")
    for e in (int(v) for v in args.experts.split(",")):
        r = measure(e, args)
        cells = [f"{m:.2f}x [{lo:.2f}, {hi:.2f}]" for m, lo, hi in (r["grouped fp32"], r["grouped bf16"])]
        print(f"{e:>8} {r['loop fp32 ms']:>13.1f} {cells[0]:>24} {cells[1]:>24}")
    print("goals: grouped fp32 <= 0.75x, grouped bf16 <= 0.50x")


if __name__ == "__main__":
    main()
