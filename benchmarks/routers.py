"""Router cost side by side: forward+backward time of every strategy relative to Switch.

Also measures BRANCH's batched node map against a node-by-node loop (the form the
router avoids), in the same run. Ratios, not absolute times, are the result.

    .venv/bin/python benchmarks/routers.py [--tokens 4096 --hidden 256 --experts 64 --repeats 20]
"""
from __future__ import annotations

import argparse
import time

import torch

from dist_moe.routing import build_router


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def fwd_bwd(router, x, cats):
    def run():
        r = router(x, categories=cats)
        loss = r.gates.sum() + r.probs.sum() + r.aux_loss
        if loss.requires_grad:  # hash routing has nothing to differentiate
            loss.backward()

    return run


def node_loop(router, x):
    """Reference: one score per internal node, computed in a Python loop."""
    w = router.node_map.weight

    def run():
        f = torch.stack([x @ w[n] for n in range(w.shape[0])], dim=1)
        f.sum().backward()

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the documented numbers)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    x = torch.randn(a.tokens, a.hidden, requires_grad=True)
    cats = torch.randint(0, a.experts, (a.tokens,))
    base = {"hidden_size": a.hidden, "num_experts": a.experts, "top_k": a.top_k}
    cfgs = {
        "switch": {"type": "switch", **base},
        "skywork": {"type": "skywork", **base},
        "deepseek_v3": {"type": "deepseek_v3", **base},
        "hash": {"type": "hash", **base},
        "branch (linear)": {"type": "branch", **base},
        "branch (mlp h=8)": {"type": "branch", **base, "node_map": "mlp", "mlp_hidden": 8},
        # one of the two depth-1 subtrees (the node level of 2 nodes), then top-K inside it
        "branch limit 1 of 2": {"type": "branch", **base, "subtree_limit": 1, "subtree_depth": 1},
        "branch limit 2 of 8": {"type": "branch", **base, "subtree_limit": 2, "subtree_depth": 3},
        # what the default balance costs: the sign rule alone, then without evaluation's own bias
        "limit 1 of 2, sign": {"type": "branch", **base, "subtree_limit": 1, "subtree_depth": 1,
                               "balance_rule": "sign", "balance_eval": False},
        "limit 1 of 2, no eval": {"type": "branch", **base, "subtree_limit": 1, "subtree_depth": 1,
                                  "balance_eval": False},
        "deepseek_v3 node 1/2": {"type": "deepseek_v3", **base, "node_limit": 1},
        "specdrop (dense)": {"type": "specdrop", "num_experts": a.experts, "num_categories": a.experts,
                             "p_assigned": 0.7, "hidden_size": a.hidden},
    }
    routers = {name: build_router(c).train() for name, c in cfgs.items()}
    routers["deepseek_v3 node 1/2"].set_expert_groups(torch.arange(a.experts) // (a.experts // 2))  # 2 nodes
    times = {name: timed(fwd_bwd(r, x, cats), a.repeats) for name, r in routers.items()}
    ref = times["switch"]
    print(f"T={a.tokens} H={a.hidden} E={a.experts} K={a.top_k}, {torch.get_num_threads()} threads, "
          f"best of {a.repeats}")
    print(f"{'router':<24}{'ms':>9}{'vs switch':>11}")
    for name, t in times.items():
        print(f"{name:<24}{1e3 * t:>9.2f}{t / ref:>10.2f}x")
    branch = build_router(cfgs["branch (linear)"]).train()
    batched = timed(lambda: branch.node_map(x).sum().backward(), a.repeats)
    looped = timed(node_loop(branch, x), a.repeats)
    print(f"branch node scores: batched {1e3 * batched:.2f} ms, per-node loop {1e3 * looped:.2f} ms "
          f"-> loop is {looped / batched:.1f}x slower")


if __name__ == "__main__":
    main()
