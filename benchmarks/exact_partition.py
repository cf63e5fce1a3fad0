"""The placement heuristic beside the exact balanced partition (placement/exact.py, OR-Tools CP-SAT).

For dense, sparse, planted and recorded co-activation matrices at E=16/32/64, it prints each
bisection's (or 4-way split's) cut weight from ``placement.placement.balanced_partition``
beside CP-SAT's, whether the optimum was proven, the solver's bound, and the ratio.
Recorded matrices come from a real router's top-4 choices on the MAGIC rows.

    .venv/bin/python benchmarks/exact_partition.py [--seconds 10]
"""
from __future__ import annotations

import argparse
import time

import torch

from dist_moe.data.tabular import tabular_split
from dist_moe.routing import build_router
from placement.exact import exact_balanced_partition
from placement.placement import balanced_partition, cut_weight, symmetric_coactivation


def random_c(m: int, seed: int, density: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(m, m, generator=g, dtype=torch.float64) * (torch.rand(m, m, generator=g) < density)
    return symmetric_coactivation(c)


def planted_c(m: int, blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    b = torch.randperm(m, generator=g) % blocks
    return symmetric_coactivation((b[:, None] == b[None, :]) * 5.0 + torch.rand(m, m, generator=g))


def recorded_c(m: int, router_type: str, seed: int = 0) -> torch.Tensor:
    data = tabular_split("magic", 0.2, 0, 4000, None)
    torch.manual_seed(seed)
    router = build_router({"type": router_type, "hidden_size": data.x_train.shape[1], "num_experts": m, "top_k": 4})
    with torch.no_grad():
        idx = router(data.x_train).expert_idx
    onehot = torch.nn.functional.one_hot(idx, m).sum(1).double()
    return symmetric_coactivation(onehot.t() @ onehot)


CASES = [("dense", 16, 2, lambda: random_c(16, 0)), ("dense", 32, 2, lambda: random_c(32, 0)),
         ("dense", 64, 2, lambda: random_c(64, 0)), ("dense", 64, 4, lambda: random_c(64, 1)),
         ("sparse 5%", 64, 2, lambda: random_c(64, 2, 0.05)), ("sparse 5%", 64, 4, lambda: random_c(64, 3, 0.05)),
         ("planted", 64, 4, lambda: planted_c(64, 4, 4)), ("recorded switch", 32, 2, lambda: recorded_c(32, "switch")),
         ("recorded switch", 64, 2, lambda: recorded_c(64, "switch")),
         ("recorded branch", 64, 2, lambda: recorded_c(64, "branch"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="CP-SAT time limit per split")
    args = ap.parse_args()
    print("| C | E | parts | heuristic cut (s) | exact cut | proven | bound | solver s | heuristic / exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m, n, make in CASES:
        c = make()
        start = time.time()
        h = balanced_partition(c, n)
        th = time.time() - start
        r = exact_balanced_partition(c, n, h, time_limit_s=args.seconds)
        hc = cut_weight(c, h)
        print(f"| {name} | {m} | {n} | {hc:.4g} ({th:.2f}) | {r.cut:.4g} | {r.optimal} | {r.lower_bound:.3g} | "
              f"{r.seconds:.1f} | {hc / r.cut:.3f} |", flush=True)


if __name__ == "__main__":
    main()
