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
        if isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or not 0 <= int(depth) <= depth_max:
            raise ValueError(f"router key 'subtree_depth' must be an int in [0, log2(num_experts)={depth_max}], "
                             f"got {depth!r}")
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or not 1 <= int(m) <= 1 << int(depth):
            raise ValueError(f"router key 'subtree_limit' must be an int in [1, 2^subtree_depth={1 << depth}], "
                             f"got {m!r}")
        depth, m = int(depth), int(m)
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
    root, breadth first, so depth d's 2^d nodes start at 2^d - 2 and the leaves are the last E), in the
    last dimension."""
    n = 1 << depth
    return bias[..., n - 2 : 2 * n - 2]


def limited_top_k(probs: Tensor, top_k: int, limits: list[tuple[int, int]],
                  bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Top-K leaves inside the kept subtrees: (values, indices), highest probability first, ties to
    the lower index. The values are the leaves' own probabilities, so gradients flow through the
    kept path masses. ``bias`` (per tree node, ``node_bias``) enters the selection only, as
    DeepSeek-V3's expert bias does: subtrees are ranked by path mass + bias, leaves inside them by
    probability + bias, and the chosen leaves are reported in order of their own probability."""
    idx, _ = limited_selection(probs, top_k, limits, bias)
    return probs.gather(1, idx), idx


def balance_slope(probs: Tensor, top_k: int, limits: list[tuple[int, int]], bias: Tensor,
                  valid: Tensor | None = None) -> Tensor:
    """[2E - 2]: for every unit ``balance_step`` moves (the subtrees at each limited depth, the leaves),
    the slots its selection gains per unit of its own bias on this batch: the tokens within a window
    (``WINDOW`` / 2^d) of taking it in or leaving it out, over the window's width, times the slots
    one (token, subtree) pair carries (K / M). Zero elsewhere. ``valid`` [T] bool leaves rows out."""
    slopes = limited_selection(probs, top_k, limits, bias, valid, slope=True)[1]
    assert slopes is not None  # asked for
    return slopes


def limited_selection(probs: Tensor, top_k: int, limits: list[tuple[int, int]], bias: Tensor | None = None,
                      valid: Tensor | None = None, slope: bool = False) -> tuple[Tensor, Tensor | None]:
    """(indices [T, K], in order of the leaves' own probability; with ``slope`` the bias slopes
    ``balance_slope`` describes, else None): ``limited_top_k``'s selection and the balance's slopes
    from one sort per limited depth and one of the kept leaves, the sorts the selection needs anyway.
    ``probs`` [G, T, E] with ``bias`` [G, 2E - 2] makes G selections of T tokens at once, each with its
    own bias (indices [G, T, K], slopes [G, 2E - 2]): the same kernels, whatever G."""
    batched = probs.dim() == 3
    p = probs.detach() if batched else probs.detach().unsqueeze(0)
    b = None if bias is None else (bias if batched else bias.unsqueeze(0)).unsqueeze(1)  # [G, 1, 2E - 2]
    g, t, e = p.shape
    slopes = p.new_zeros(g, 2 * e - 2) if slope else None
    # the last limited depth's kept subtrees: [G, T, n] bool (None: all), [G, T, units] ids; its subtree count
    chosen: Tensor | None = None
    kept: Tensor | None = None
    inside: Tensor | None = None
    units, above = 1, 1
    for depth, m in limits:
        n = 1 << depth
        if n == 1:  # the root: its one subtree is always kept (and has no bias of its own)
            continue
        score = p.reshape(g, t, n, e // n).sum(-1)
        if b is not None:
            score = score + node_bias(b, depth)
        if chosen is not None:  # only inside the subtrees the level above kept
            inside = chosen.repeat_interleave(n // chosen.shape[-1], dim=-1)
            score = torch.where(inside, score, float("-inf"))
        units, above = min(m, units * (n // above)), n
        if m < n:
            ranked, order = torch.sort(score, dim=-1, descending=True, stable=True)
            # ranked past the finite scores are subtrees outside; the first ``units`` are all inside
            kept = order[..., :units]
            chosen = torch.zeros_like(score, dtype=torch.bool).scatter(-1, kept, True)
            if slopes is not None:
                node_bias(slopes, depth).copy_(_near_the_cut(score, chosen, ranked, m, WINDOW / n, valid) * top_k / m)
        else:  # limits nothing: every subtree inside stays
            chosen = inside if chosen is not None else torch.ones_like(score, dtype=torch.bool)
            kept = None
    leaf = p if b is None else p + node_bias(b, e.bit_length() - 1)
    if kept is not None:  # only the kept subtrees' leaves, in index order (so ties still go to the lower)
        assert chosen is not None  # kept with it
        per = e // chosen.shape[-1]
        kept = kept.sort(dim=-1).values if units > 1 else kept
        ids = (kept[..., None] * per + torch.arange(per, device=p.device)).reshape(g, t, units * per)
        score = leaf.gather(-1, ids)
    else:
        ids = torch.arange(e, device=p.device).expand(g, t, e)
        score = leaf if chosen is None else torch.where(
            chosen.repeat_interleave(e // chosen.shape[-1], dim=-1), leaf, float("-inf"))
    ranked, order = torch.sort(score, dim=-1, descending=True, stable=True)
    idx = ids.gather(-1, order[..., :top_k])
    if slopes is not None:
        near = _near_the_cut(score, torch.zeros_like(score, dtype=torch.bool).scatter(-1, order[..., :top_k], True),
                             ranked, top_k, WINDOW / e, valid, per_token=True)
        # a token's candidates are distinct leaves: laid out over the leaves, then summed over tokens
        node_bias(slopes, e.bit_length() - 1).copy_(p.new_zeros(g, t, e).scatter(-1, ids, near).sum(-2)
                                                    / (2 * WINDOW / e))
    if b is not None:  # reported in order of the leaves' own probability
        by_prob = torch.sort(p.gather(-1, idx), dim=-1, descending=True, stable=True).indices
        idx = idx.gather(-1, by_prob)
    if batched:
        return idx, slopes
    return idx[0], None if slopes is None else slopes[0]


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
    replicas that must stay equal. Leading dimensions ([G, E], [G, 2E - 2]) step G biases at once."""
    e = load.shape[-1]
    load = load.to(bias.dtype)
    for depth in sorted({d for d, _ in limits} | {e.bit_length() - 1}):
        n = 1 << depth
        units = load.reshape(*load.shape[:-1], n, e // n).sum(-1)
        short = units.mean(-1, keepdim=True) - units
        if rule == "sign":
            node_bias(bias, depth).add_(rate / n * torch.sign(short))
        else:  # no tokens near the cut (slope 0): the window's step toward balance
            assert slope is not None, "the newton rule steps by the slopes"
            h = WINDOW / n
            step = torch.where(short == 0, 0.0, rate * short / node_bias(slope, depth).to(bias.dtype))
            node_bias(bias, depth).add_(step.nan_to_num(posinf=h, neginf=-h).clamp(-h, h))


def _near_the_cut(score: Tensor, chosen: Tensor, ranked: Tensor, m: int, h: float, valid: Tensor | None,
                  per_token: bool = False) -> Tensor:
    """[..., n]: tokens whose choice of each unit flips within a bias change of h (a kept unit within h
    of the best one left out, one left out within h of the M-th kept), over 2h: the slope of the
    unit's count in its own bias (``per_token``: [..., T, n], 1.0 where a token is near, not yet
    summed or scaled). ``score`` [..., T, n]; ``ranked``: it sorted, descending. A token with no unit
    left out (M >= its candidates) cannot flip."""
    if ranked.shape[-1] <= m:
        return score.new_zeros(score.shape if per_token else score.shape[:-2] + score.shape[-1:])
    last_in, first_out = ranked[..., m - 1 : m], ranked[..., m : m + 1]
    leave = chosen & (score - first_out < h)
    join = ~chosen & torch.isfinite(score) & (last_in - score < h)
    near = leave | join
    if valid is not None:
        near = near & (valid.reshape(-1, 1) != 0)  # a float mask (the routers') or bool
    if per_token:
        return near.to(score.dtype)
    return near.sum(-2).to(score.dtype) / (2 * h)


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
