"""Tree distance between co-selected experts (BRANCH paper, appendix B.4).

L(i, j) = bit_length(i XOR j): the number of levels up to the lowest common
ancestor when expert ids are read as root-to-leaf paths. Under block
placement on 2^m devices two experts share a device iff L <= D - m.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _depth(num_experts: int) -> int:
    if num_experts < 2:
        raise ValueError(f"tree distance needs num_experts >= 2, got {num_experts}")
    return (num_experts - 1).bit_length()


def tree_distance(expert_idx: Tensor, num_experts: int) -> float:
    """Mean over tokens and co-selected pairs i<j of bit_length(i ^ j) / log2(E).

    Slots dropped by capacity (-1) are left out and the mean is pooled over all remaining
    pairs; NaN when no token has two experts. For E not a power of two the tree depth
    is ceil(log2 E).
    """
    d = _depth(num_experts)
    if expert_idx.dim() != 2:
        raise ValueError(f"expert_idx must be [T, K], got shape {tuple(expert_idx.shape)}")
    k = expert_idx.shape[1]
    if k < 2 or expert_idx.shape[0] == 0:
        return float("nan")
    i, j = torch.triu_indices(k, k, offset=1, device=expert_idx.device)
    a, b = expert_idx[:, i], expert_idx[:, j]
    valid = (a >= 0) & (b >= 0)
    if not bool(valid.any()):
        return float("nan")
    x = (a ^ b)[valid]
    bit_length = torch.zeros_like(x)
    for s in range(d):
        bit_length += (x >> s) != 0
    return float(bit_length.double().mean()) / d


def node_share(load: Tensor, expert_node: Tensor, num_nodes: int | None = None) -> tuple[list[float], float]:
    """Each node's share of the routed (token, expert) slots, from per-expert ``load``, and the
    shares' CV (std / mean): what BRANCH's anchors keep balanced when a subtree limit makes the
    node the router's top-level choice."""
    share = _per_unit(load, expert_node, num_nodes)
    share = share / share.sum().clamp_min(1e-12)
    cv = float(share.std(unbiased=False) / share.mean()) if len(share) > 1 else 0.0
    return [round(v, 5) for v in share.tolist()], cv


def busiest(load: Tensor, expert_unit: Tensor, num_units: int | None = None) -> float:
    """The most loaded unit's (rank's, node's) routed slots over the mean unit's, from per-expert
    ``load``: 1.0 is perfect balance; the busiest rank sets an expert-parallel step's time."""
    per = _per_unit(load, expert_unit, num_units)
    return float(per.max() / per.mean()) if per.sum() > 0 else float("nan")


def _per_unit(load: Tensor, expert_unit: Tensor, num_units: int | None) -> Tensor:
    """[units] float64 on the CPU: per-expert ``load`` summed over each expert's unit (node, rank)."""
    units = expert_unit.cpu().long()
    n = num_units or int(units.max()) + 1
    return torch.zeros(n, dtype=torch.float64).scatter_add_(0, units, load.double().cpu())


def random_pair_tree_distance(num_experts: int) -> float:
    """E[L]/D for uniformly random distinct pairs: (D - 1 + 2^-D) / (1 - 2^-D) / D."""
    d = _depth(num_experts)
    if 1 << d != num_experts:
        raise ValueError(f"the closed form needs num_experts a power of two, got {num_experts}")
    return (d - 1 + 2.0**-d) / (1 - 2.0**-d) / d
