"""BRANCH's evaluation routing against its training routing on the tiny LM, node by node.

In training BRANCH routes with each batch's own arrival-weighted statistic (eq. 5-6, summed over
the data-parallel group); in evaluation with the EMA anchors (eq. 7). This trains the lm_routers
cell (configs/lm_branch.yaml, E=8 top-2, subtree_limit 1, seed 0, 200 steps, 4 ranks as 2 x 2)
with the given balance, then routes the same validation rows both ways and prints each MoE
layer's node shares and busiest rank / mean, the root's balance bias and EMA anchor.

    DIST_MOE_TOPOLOGY=node=2,gpu=2 OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 4 \\
        benchmarks/eval_anchors.py bias        # or: none; then any router overrides, e.g. router.balance_rule=sign
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_moe.moe.view import moe_layers  # noqa: E402
from dist_moe.train.config import load_config  # noqa: E402
from dist_moe.train.metrics.routing import routing_metrics  # noqa: E402
from dist_moe.train.trainer import train  # noqa: E402

ROWS = 2048  # validation sequences per rank


def _routing(model, x, rt, batch_statistics: bool) -> list:
    """Each MoE layer's (node shares, busiest rank) for one forward of ``x`` in evaluation mode,
    its routers routing with the batch's statistic (state frozen) or with their EMA anchors."""
    layers = moe_layers(model)
    model.eval()
    with contextlib.ExitStack() as stack, torch.no_grad():
        if batch_statistics:
            for layer in layers:
                layer.router.train()
                stack.enter_context(layer.router.frozen_state())
        model(x)
        out = []
        for layer in layers:
            r = layer.last_routing
            load = rt.sum(r.stats["load"].double())
            m = routing_metrics(r.expert_idx, load, 0, layer.num_experts, layer.expert_node, layer.expert_rank)
            out.append({"node_share": m["node_share"], "busiest_rank": round(m["busiest_rank"], 3)})
    model.train()
    return out


def after(model, data, rt) -> dict:
    mine = torch.tensor_split(torch.arange(len(data.x_val)), rt.world)[rt.rank][:ROWS]
    x = data.x_val[mine].to(rt.device)
    routers = [layer.router for layer in moe_layers(model)]
    return {"eval_anchors": _routing(model, x, rt, False), "batch_statistic": _routing(model, x, rt, True),
            "root_bias": [r.balance_bias[:2].tolist() if hasattr(r, "balance_bias") else None for r in routers],
            "root_anchor": [round(float(r.anchors[0]), 4) for r in routers]}


def main() -> None:
    balance = sys.argv[1] if len(sys.argv) > 1 else "bias"
    extra = sys.argv[2:]  # router overrides, e.g. the balance rule
    cfg = load_config("configs/lm_branch.yaml", [
        "seed=0", "router.type=branch", "router.node_map=linear", "router.subtree_limit=1",
        f"router.subtree_balance={balance}", "parallel.placement=tree_prefix", "parallel.dedup=node",
        "train.max_steps=200", "data.per_domain=500", "train.log_every=50",
        f"output.dir=/tmp/dist_moe_eval_anchors/{balance}", "output.overwrite=true", *extra])
    summary = train(cfg, quiet=True, after=after)
    if os.environ.get("RANK", "0") == "0":
        keys = ("eval_anchors", "batch_statistic", "root_bias", "root_anchor", "val_node_share_cv", "val_loss")
        print(json.dumps({"balance": balance, "overrides": extra, **{k: summary[k] for k in keys}}))


if __name__ == "__main__":
    main()
