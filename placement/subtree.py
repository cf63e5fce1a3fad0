"""Subtree-limited selection: a token's K experts from at most M subtrees of the expert tree at depth d.

BRANCH-MoE's router selects this way when given ``subtree_limit`` (``dist_moe.routing.branch``),
and ``simulate`` replays a run's recorded probabilities this way on a cluster it does not have;
it lives here, with the other tree arithmetic of expert indices, so both use the one function.

A BRANCH tree's subtree at depth d holds the E / 2^d experts that share a d-bit index prefix;
under tree-prefix placement on power-of-two levels the subtrees at a level's depth are exactly
that level's units (racks, nodes), so a limit on subtrees is a limit on the nodes a token's
copies cross to, told to the router for free. Subtrees are ranked by the token's path mass, the
product of its branch probabilities down to the subtree's root (the sum of its leaf
probabilities); the best M are kept and the top-K leaves are chosen inside them. Several
limits nest, outermost first (``[(1, 1), (2, 2)]``: one rack, then two of its nodes). Pure
tensor math with fixed shapes: no host reads.
"""
from __future__ import annotations

import numbers

import torch
from torch import Tensor


def check_limits(limits, num_experts: int, top_k: int) -> list[tuple[int, int]]:
    """Validated (depth, M) pairs, sorted outermost first; a ValueError names the bad value."""
    depth_max = num_experts.bit_length() - 1
    out = []
    for depth, m in sorted(limits):
        if isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or not 0 <= depth <= depth_max:
            raise ValueError(f"router key 'subtree_depth' must be an int in [0, log2(num_experts)={depth_max}], "
                             f"got {depth!r}")
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or not 1 <= m <= 1 << depth:
            raise ValueError(f"router key 'subtree_limit' must be an int in [1, 2^subtree_depth={1 << depth}], "
                             f"got {m!r}")
        leaves = num_experts >> depth
        if top_k > m * leaves:
            raise ValueError(f"router key 'subtree_limit': top_k={top_k} experts do not fit in {m} subtree(s) of "
                             f"{leaves} experts at depth {depth}")
        out.append((int(depth), int(m)))
    if len({d for d, _ in out}) != len(out):
        raise ValueError(f"router key 'subtree_limit' names depth {out} more than once")
    return out


def node_bias(bias: Tensor, depth: int) -> Tensor:
    """The slice of a per-node selection bias (``BranchRouter.balance_bias``: every tree node below the
    root, breadth first, so depth d's 2^d nodes start at 2^d - 2 and the leaves are the last E)."""
    n = 1 << depth
    return bias[n - 2 : 2 * n - 2]


def subtree_mask(probs: Tensor, limits: list[tuple[int, int]], bias: Tensor | None = None) -> Tensor:
    """[T, E] bool: the leaves inside each token's kept subtrees (ranked by path mass, plus the
    subtree's selection bias when ``bias`` is given; ties to the lower index), every limit applied
    inside the subtrees the one before it kept."""
    t, e = probs.shape
    mass_all = probs.detach()
    allowed = torch.ones(t, e, dtype=torch.bool, device=probs.device)
    for depth, m in limits:
        n = 1 << depth
        inside = allowed.reshape(t, n, e // n).any(-1)
        score = mass_all.reshape(t, n, e // n).sum(-1)
        if bias is not None:
            score = score + node_bias(bias, depth)
        mass = torch.where(inside, score, float("-inf"))
        if m < n:
            keep = torch.sort(mass, dim=1, descending=True, stable=True).indices[:, :m]
            chosen = torch.zeros(t, n, dtype=torch.bool, device=probs.device).scatter(1, keep, True) & inside
        else:
            chosen = inside
        allowed = chosen[:, :, None].expand(t, n, e // n).reshape(t, e)
    return allowed


def limited_top_k(probs: Tensor, top_k: int, limits: list[tuple[int, int]],
                  bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Top-K leaves inside the kept subtrees: (values, indices), highest probability first, ties to
    the lower index. The values are the leaves' own probabilities, so gradients flow through the
    kept path masses. ``bias`` (per tree node, ``node_bias``) enters the selection only, as
    DeepSeek-V3's expert bias does: subtrees are ranked by path mass + bias, leaves inside them by
    probability + bias, and the chosen leaves are reported in order of their own probability."""
    allowed = subtree_mask(probs, limits, bias)
    if bias is None:
        order = torch.sort(torch.where(allowed, probs.detach(), -1.0), dim=1, descending=True, stable=True).indices
        idx = order[:, :top_k]
        return probs.gather(1, idx), idx
    e = probs.shape[1]
    score = torch.where(allowed, probs.detach() + node_bias(bias, e.bit_length() - 1), float("-inf"))
    chosen = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :top_k]
    by_prob = torch.sort(probs.detach().gather(1, chosen), dim=1, descending=True, stable=True).indices
    idx = chosen.gather(1, by_prob)
    return probs.gather(1, idx), idx


def balance_step(bias: Tensor, load: Tensor, limits: list[tuple[int, int]], rate: float) -> None:
    """Move ``bias`` (in place) toward equal hard load: at every limited depth each subtree's bias by
    ``rate`` / 2^d (the mean path mass there) toward its depth's mean slot count, and every leaf's by
    ``rate`` / E toward the mean expert load; the sign rule of DeepSeek-V3's auxiliary-loss-free
    balancing, on the tree's units. ``load`` [E]: selected (token, expert) slots per expert, summed
    over the replicas that must stay equal."""
    e = load.shape[0]
    load = load.to(bias.dtype)
    for depth in sorted({d for d, _ in limits} | {e.bit_length() - 1}):
        n = 1 << depth
        units = load.reshape(n, e // n).sum(-1)
        node_bias(bias, depth).add_(rate / n * torch.sign(units.mean() - units))


def level_depths(levels: dict, topology_levels: tuple, sizes: tuple, num_experts: int) -> list[tuple[int, int]]:
    """{level name: M} -> [(depth, M)]: a level's units are the subtrees at depth log2(units so far)
    when the level sizes are powers of two and tree-prefix placement put them there. A limit of
    more units than the topology has (``node: 2`` on one node) would limit nothing and is refused;
    one of exactly as many (``node: 1`` on one node) limits nothing either, which lets a cluster's
    config run on fewer nodes. Two levels of one depth keep the tighter limit."""
    out: dict[int, int] = {}
    for name, m in levels.items():
        if name not in topology_levels:
            raise ValueError(f"router key 'subtree_limit' names level {name!r}; the topology's levels are "
                             f"{list(topology_levels)}")
        units = 1
        for size in sizes[: topology_levels.index(name) + 1]:
            units *= size
        if units & (units - 1) or units > num_experts:
            raise ValueError(f"router key 'subtree_limit': the {units} {name}s of the topology are not subtrees "
                             f"of a {num_experts}-expert tree (their count must be a power of two <= num_experts)")
        if m > units:
            raise ValueError(f"router key 'subtree_limit' allows {m} {name}s, but the topology has {units}: "
                             f"a limit of more {name}s than there are limits nothing; give at most {units}")
        depth = units.bit_length() - 1
        out[depth] = min(out.get(depth, m), m)
    return sorted(out.items())
