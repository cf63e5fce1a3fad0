"""Routing metrics every run can report."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from placement import busiest, node_share, tree_distance


def load_cv(load: Tensor) -> float:
    """Population std / mean of per-expert load."""
    load = load.double()
    mean = load.mean()
    return float(load.std(unbiased=False) / mean) if mean > 0 else float("nan")


def routing_metrics(expert_idx: Tensor, load: Tensor, dropped: int, num_experts: int,
                    expert_node: Tensor | None = None, expert_rank: Tensor | None = None) -> dict:
    """Load CV, normalised tree distance and dropped-slot fraction of one or more routings; with
    ``expert_node`` ([E]: each expert's node) each node's share of the slots and that share's CV,
    beside expert load: what BRANCH's anchors keep balanced when a subtree limit makes the
    top-level decision the node choice; with ``expert_rank`` the busiest rank's slots over the mean
    rank's (``busiest_rank``)."""
    tree = num_experts >= 2 and not num_experts & (num_experts - 1)  # a complete binary tree of experts
    td = tree_distance(expert_idx, num_experts) if tree and expert_idx.shape[1] >= 2 else math.nan
    out = {
        "load_cv": load_cv(load),
        "tree_distance": td,
        "dropped_fraction": float(dropped) / max(expert_idx.numel(), 1),
    }
    if expert_node is not None:
        out["node_share"], out["node_share_cv"] = node_share(load, expert_node)
    if expert_rank is not None:
        out["busiest_rank"] = busiest(load, expert_rank)
    return out


def layers_metrics(per_layer: list[dict]) -> dict:
    """One MoE layer's metrics as they are; with several, each key's mean over the layers, and every
    layer's own as ``layer<i>_<key>`` (as the bytes are logged)."""
    if len(per_layer) == 1:
        return per_layer[0]

    def mean(values):  # a number, or a list of them (each node's share) averaged position by position
        if isinstance(values[0], (list, tuple)):
            return [mean(column) for column in zip(*values)]
        return math.fsum(values) / len(values)

    out = {k: mean([m[k] for m in per_layer]) for k in per_layer[0]}
    if "node_share" in out:  # the CV of the mean shares printed beside it, not the mean of each layer's CV
        out["node_share_cv"] = load_cv(torch.tensor(out["node_share"], dtype=torch.float64))
    out.update({f"layer{i}_{k}": v for i, m in enumerate(per_layer) for k, v in m.items()})
    return out


def routing_tensors(layers) -> list[Tensor]:
    """What ``host_layer_metrics`` needs of every layer's last routing, as device tensors: the log step
    reads them back in the same transfer as its reduced values."""
    out = []
    for layer in layers:
        r = layer.last_routing
        dropped = r.stats.get("dropped", 0)
        out += [r.expert_idx, r.stats["load"], dropped if torch.is_tensor(dropped) else torch.zeros(())]
    return out


def host_layer_metrics(layers, copies: list[Tensor]) -> list[dict]:
    """``routing_metrics`` of every layer's last routing from ``copies`` (``routing_tensors``, copied to
    the host): host math, no read of the device."""
    out = []
    for layer, idx, load, dropped in zip(layers, copies[0::3], copies[1::3], copies[2::3]):
        count = layer.last_routing.stats.get("dropped", 0)
        count = int(dropped) if torch.is_tensor(count) else count  # a host int already
        out.append(routing_metrics(idx, load, count, layer.num_experts, layer.expert_node, layer.expert_rank))
    return out
