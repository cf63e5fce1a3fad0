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


BALANCE_RULES = ("sign", "newton")
# each rule's balance_rate: sign's chosen on seed 0 (benchmarks/README.md "Balanced subtree limit"),
# newton's on seed 0 of the cells in "Balance on data the router never saw" (0.3: noisier at balance)
DEFAULT_RATES = {"sign": 1e-2, "newton": 0.1}
# newton's window, relative to the mean path mass at a depth: where it counts the tokens about to move,
# and the most a bias moves in one step (beyond it the batch says nothing about the load)
WINDOW = 0.1


def balance_step(bias: Tensor, load: Tensor, limits: list[tuple[int, int]], rate: float, rule: str = "sign",
                 slope: Tensor | None = None) -> None:
    """Move ``bias`` (in place) toward equal hard load, at every limited depth and at the leaves.

    ``sign``: each unit's bias by ``rate`` / 2^d (the mean path mass at depth d) toward its depth's
    mean load, whatever the shortfall: DeepSeek-V3's auxiliary-loss-free rule, on the tree's units.
    ``newton``: by ``rate`` times the shortfall in slots (mean - load) over ``slope``
    (``balance_slope``: the slots the unit gains per unit of its bias, measured on the same batch),
    at most ``WINDOW`` / 2^d: the fraction ``rate`` of the step that would balance the batch,
    whatever the data and node map make of a bias (peaked path masses move many tokens per unit of
    bias, spread ones few), so it neither lags a distribution that moves nor rings at balance.
    ``load`` [E]: selected (token, expert) slots per expert; ``load`` and ``slope`` summed over the
    replicas that must stay equal."""
    e = load.shape[0]
    load = load.to(bias.dtype)
    for depth in sorted({d for d, _ in limits} | {e.bit_length() - 1}):
        n = 1 << depth
        units = load.reshape(n, e // n).sum(-1)
        short = units.mean() - units
        if rule == "sign":
            node_bias(bias, depth).add_(rate / n * torch.sign(short))
        else:  # no tokens near the cut (slope 0): the window's step toward balance
            h = WINDOW / n
            step = torch.where(short == 0, 0.0, rate * short / node_bias(slope, depth).to(bias.dtype))
            node_bias(bias, depth).add_(step.nan_to_num(posinf=h, neginf=-h).clamp(-h, h))


def balance_slope(probs: Tensor, top_k: int, limits: list[tuple[int, int]], bias: Tensor,
                  valid: Tensor | None = None) -> Tensor:
    """[2E - 2]: for every unit ``balance_step`` moves (the subtrees at each limited depth, the leaves),
    the slots its selection gains per unit of its own bias on this batch: the tokens within a window
    (``WINDOW`` / 2^d) of taking it in or leaving it out, over the window's width, times the slots
    one (token, subtree) pair carries (K / M). Zero elsewhere. ``valid`` [T] bool leaves rows out."""
    t, e = probs.shape
    probs = probs.detach()
    slope = torch.zeros_like(bias)
    for i, (depth, m) in enumerate(limits):
        n = 1 << depth
        inside = subtree_mask(probs, limits[:i], bias).reshape(t, n, e // n).any(-1)
        score = torch.where(inside, probs.reshape(t, n, e // n).sum(-1) + node_bias(bias, depth), float("-inf"))
        chosen = subtree_mask(probs, limits[: i + 1], bias).reshape(t, n, e // n).any(-1)
        node_bias(slope, depth).copy_(_near_the_cut(score, chosen, m, WINDOW / n, valid) * top_k / m)
    allowed = subtree_mask(probs, limits, bias)
    score = torch.where(allowed, probs + node_bias(bias, e.bit_length() - 1), float("-inf"))
    top = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :top_k]
    chosen = torch.zeros_like(allowed).scatter(1, top, True)
    node_bias(slope, e.bit_length() - 1).copy_(_near_the_cut(score, chosen, top_k, WINDOW / e, valid))
    return slope


def _near_the_cut(score: Tensor, chosen: Tensor, m: int, h: float, valid: Tensor | None) -> Tensor:
    """[n]: tokens whose choice of each unit flips within a bias change of h (a kept unit within h of
    the best one left out, one left out within h of the M-th kept), over 2h: the slope of the unit's
    count in its own bias. A token with no unit left out (M >= its candidates) cannot flip."""
    ranked = torch.sort(score, dim=1, descending=True).values
    if ranked.shape[1] <= m:
        return score.new_zeros(score.shape[1])
    last_in, first_out = ranked[:, m - 1 : m], ranked[:, m : m + 1]
    leave = chosen & (score - first_out < h)
    join = ~chosen & torch.isfinite(score) & (last_in - score < h)
    near = leave | join
    if valid is not None:
        near = near & valid.reshape(-1, 1)
    return near.sum(0).to(score.dtype) / (2 * h)


def tree_probs(scores: Tensor, anchors: Tensor) -> Tensor:
    """[T, E] leaf masses of node scores ``scores`` [T, E-1] under fixed ``anchors`` [E-1] (BRANCH's
    eq. 8-12 as evaluation routes, both breadth first): what a router in evaluation would select
    from, for a bias that balances evaluation's routing (``BranchRouter``)."""
    masks = scores.new_ones(scores.shape[0], 1)
    for d in range((scores.shape[1] + 1).bit_length() - 1):
        lo, hi = (1 << d) - 1, (1 << (d + 1)) - 1
        p = torch.sigmoid(scores[:, lo:hi] - anchors[lo:hi])
        masks = torch.stack((masks * (1 - p), masks * p), dim=2).reshape(scores.shape[0], 2 << d)
    return masks


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
