"""Routing metrics every run can report (DESIGN 5)."""
from __future__ import annotations

import math

from torch import Tensor

from placement import node_share, tree_distance


def load_cv(load: Tensor) -> float:
    """Population std / mean of per-expert load."""
    load = load.double()
    mean = load.mean()
    return float(load.std(unbiased=False) / mean) if mean > 0 else float("nan")


def routing_metrics(expert_idx: Tensor, load: Tensor, dropped: int, num_experts: int,
                    expert_node: Tensor | None = None) -> dict:
    """Load CV, normalised tree distance and dropped-slot fraction of one or more routings; with
    ``expert_node`` ([E]: each expert's node) each node's share of the slots and that share's CV,
    beside expert load: what BRANCH's anchors keep balanced when a subtree limit makes the
    top-level decision the node choice."""
    tree = num_experts >= 2 and not num_experts & (num_experts - 1)  # a complete binary tree of experts
    td = tree_distance(expert_idx, num_experts) if tree and expert_idx.shape[1] >= 2 else math.nan
    out = {
        "load_cv": load_cv(load),
        "tree_distance": td,
        "dropped_fraction": float(dropped) / max(expert_idx.numel(), 1),
    }
    if expert_node is not None:
        out["node_share"], out["node_share_cv"] = node_share(load, expert_node)
    return out


def metrics_of(routing, num_experts: int, expert_node: Tensor | None = None) -> dict:
    return routing_metrics(routing.expert_idx, routing.stats["load"], routing.stats.get("dropped", 0), num_experts,
                           expert_node)
