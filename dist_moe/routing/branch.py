"""BRANCH-MoE: binary-tree routing with arrival-weighted EMA score anchors.

Equation numbers refer to section 3 of Fu et al., "BRANCH-MoE: Balance-Aware Tree Routing for
Large Embedding Models".

Nodes are stored breadth first: depth d holds nodes [2^d - 1, 2^(d+1) - 1), and
node (d, j) has children (d+1, 2j) (left, mass m(1-p)) and (d+1, 2j+1) (right,
mass m p). Leaf e's root-to-leaf path is the D-bit binary expansion of e, most
significant bit at the root, so tree prefixes are expert-index prefixes.
"""
from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from dist_moe.routing.base import Router, Routing, expert_load, pick, select_top_k, zero_aux
from dist_moe.routing.node_map import NodeMap
from dist_moe.routing.tree_anchors import batch_anchors
from placement.subtree import (
    BALANCE_RULES,
    DEFAULT_RATES,
    balance_step,
    check_limits,
    level_depths,
    limited_selection,
    tree_probs,
)

BALANCES = ("none", "bias")
# chosen by measurement (benchmarks/README.md "Balanced subtree limit"): what a limit balances with
DEFAULT_BALANCE = "bias"
# chosen by measurement (benchmarks/README.md "Balance on data the router never saw"): how the bias moves
DEFAULT_BALANCE_RULE = "newton"


class BranchRouter(Router):
    """BRANCH-MoE: a binary tree over the experts, each token descending it by learned scores against EMA
    anchors; a tree prefix names a subtree of experts, so ``subtree_limit`` caps the nodes a token reaches."""

    # buffers (register_buffer): typed here for the type checker, which sees Module attributes otherwise
    anchors: Tensor
    ema_step: Tensor
    balance_bias: Tensor

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        node_map: str = "linear",
        mlp_hidden: int | None = None,
        ema_decay: float = 0.99,
        eta: float | None = None,
        subtree_limit: int | dict | None = None,
        subtree_depth: int | None = None,
        subtree_balance: str | None = None,
        balance_rate: float | None = None,
        balance_rule: str | None = None,
        balance_eval: bool = True,
        stats_group=None,
    ):
        """``subtree_limit``: at most M subtrees of depth ``subtree_depth`` per token (``placement/subtree.py``);
        a mapping {topology level: M}, or an int without a depth (the node level), is resolved by the
        layer from its topology and tree-prefix placement (``resolve_subtree_levels``). None: the paper's
        router, unchanged.

        ``subtree_balance`` (with a subtree limit; default ``DEFAULT_BALANCE``) is **an extension of the
        BRANCH paper, not its equation**. The paper's anchors balance the *soft* masses, but the limit
        takes *hard* decisions, which they leave unbalanced. ``"bias"`` equalises the hard selections:
        a selection bias per tree node (``balance_bias``) enters the ranking of subtrees at every
        limited depth and of leaves inside them, never the gates, and moves each training forward
        toward equal slot counts, from hard loads summed over the stats group: DeepSeek-V3's
        auxiliary-loss-free bias, on the tree's units. ``balance_rule`` (default
        ``DEFAULT_BALANCE_RULE``; ``placement.subtree.balance_step``) is how far it moves: ``"newton"``
        the fraction ``balance_rate`` of the step that would balance the batch, from the load's slope
        in the bias measured on the batch; ``"sign"`` ``balance_rate`` relative to the mean path mass
        at its depth, whatever the shortfall (DeepSeek-V3's rule). ``balance_rate`` defaults to the
        rule's ``DEFAULT_RATES``. Training routes against each batch's statistic, evaluation against
        the EMA anchors (eq. 7), whose masses differ wherever the node scores still move; so with
        ``balance_eval`` (default) evaluation selects with a second bias (``eval_balance.balance_bias``),
        moved each training forward by the same rule from the selections the EMA anchors would make
        of the batch. The anchors, masses and gates stay the paper's.
        ``"none"``: the limit as in ``placement.subtree``, with no state of its own."""
        super().__init__(num_experts, top_k, stats_group)
        num_experts = self.num_experts
        if num_experts < 2 or num_experts & (num_experts - 1):
            raise ValueError(f"num_experts must be a power of two >= 2 for BranchRouter, got {num_experts!r}")
        if not 0.0 < float(ema_decay) < 1.0:
            raise ValueError(f"ema_decay must lie in (0, 1), got {ema_decay!r}")
        if eta is None:
            eta = 1.0 if self.top_k > 1 else 0.0  # paper default: eta = 1{K > 1}
        if eta not in (0, 1):
            raise ValueError(f"eta must be 0 or 1 (eq. 21), got {eta!r}")
        self.hidden_size = hidden_size
        self.depth = num_experts.bit_length() - 1
        self.ema_decay = float(ema_decay)
        self.eta = float(eta)
        self.node_map = NodeMap(hidden_size, num_experts - 1, node_map, mlp_hidden)
        self.register_buffer("anchors", torch.zeros(num_experts - 1))
        self.register_buffer("ema_step", torch.zeros((), dtype=torch.long))
        self.subtree_limit, self.subtree_depth = _check_subtree_keys(subtree_limit, subtree_depth)
        self.subtree_levels = None  # [(depth, M)], outermost first, once known
        if isinstance(subtree_limit, int) and subtree_depth is not None:
            self.subtree_levels = check_limits([(subtree_depth, subtree_limit)], num_experts, self.top_k)
        self.subtree_balance = _check_balance(subtree_balance, self.subtree_limit)
        self.balance_rule = _check_rule(balance_rule)
        self.balance_rate = _check_rate(DEFAULT_RATES[self.balance_rule] if balance_rate is None else balance_rate)
        if not isinstance(balance_eval, bool):
            raise ValueError(f"router key 'balance_eval' must be true or false, got {balance_eval!r}")
        self.balance_eval = balance_eval
        if self.subtree_balance == "bias":  # every node below the root, breadth first (placement.subtree.node_bias)
            self.register_buffer("balance_bias", torch.zeros(2 * num_experts - 2))
            if balance_eval:
                self.eval_balance = _EvalBias(2 * num_experts - 2)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a checkpoint from before the balance (checkpoint.ADDED_SINCE) starts it at zero, here too
        if self.subtree_balance == "bias" and prefix + "balance_bias" not in state_dict:
            state_dict[prefix + "balance_bias"] = torch.zeros_like(self.balance_bias)
        if not hasattr(self, "eval_balance"):  # evaluation's bias follows training's: a router without it drops it
            state_dict.pop(prefix + "eval_balance.balance_bias", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _limits(self) -> bool:
        """Whether a level limits anything (one node's limit of 1 does not: nothing to balance)."""
        return any(m < 1 << d for d, m in self.subtree_levels or ())

    @property
    def needs_topology(self) -> bool:
        """A limit given by topology level (or an int without a depth) that no layer has resolved yet."""
        return self.subtree_limit is not None and self.subtree_levels is None

    def resolve_subtree_levels(self, levels: tuple, sizes: tuple, tree_prefix: bool) -> None:
        """Turn a limit by level ({"node": 1}; an int means the node level) into depths: under
        tree-prefix placement a level's units are the subtrees at depth log2(its unit count)."""
        if not self.needs_topology:
            return
        if not tree_prefix:
            raise ValueError("router key 'subtree_limit' by topology level needs parallel.placement=tree_prefix: "
                             "under another placement the tree's subtrees are not nodes (give subtree_depth to "
                             "limit subtrees anyway)")
        limit = self.subtree_limit
        by_level = limit if isinstance(limit, dict) else {_node_level(levels): limit}
        self.subtree_levels = check_limits(level_depths(by_level, levels, sizes, self.num_experts), self.num_experts,
                                           self.top_k)

    def node_scores(self, x: Tensor) -> Tensor:
        """f_j(x) for all E-1 nodes, [T, E-1] fp32, one batched computation."""
        return self.node_map(x)

    def forward(self, x: Tensor, categories: Tensor | None = None, token_ids: Tensor | None = None,
                valid: Tensor | None = None) -> Routing:
        if self.needs_topology:  # before anything moves the anchors
            raise ValueError("router key 'subtree_limit' is given by topology level: build the router in an "
                             "MoELayer (or engine host) that knows the topology, or give subtree_depth")
        x = self.check_input(x, self.hidden_size)
        keep = self.check_valid(valid, x.shape[0])
        f = self.node_scores(x)
        if self.training:  # eq. 5-7: each depth's anchor is the batch statistic, summed over the replicas
            a, mass = batch_anchors(f, self.depth, keep, self.stats_group)
            if self.updates_state:
                self._update_anchors(a.detach(), mass)
        else:
            a = self.anchors
        probs = tree_probs(f, a)  # eq. 8-12: leaf masks, rows sum to 1

        bias = self._selection_bias()
        if self.subtree_levels is None:
            vals, idx = select_top_k(probs, self.top_k)
            load = expert_load(idx, self.num_experts, valid=keep)
        elif bias is not None and self.updates_state:
            idx, load = self._select_and_balance(f, probs, keep)
            vals = pick(probs, idx)
        else:  # at most M subtrees per token, ranked by path mass; the eta rule over the kept selection
            # the values picked here: a gather's backward would scatter-add (with atomics on a GPU)
            idx, _ = limited_selection(probs, self.top_k, self.subtree_levels, bias)
            vals, load = pick(probs, idx), expert_load(idx, self.num_experts, valid=keep)
        gates = vals
        if self.eta:
            gates = vals / vals.sum(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)  # eq. 21
        stats = {"load": load}
        return Routing(probs=probs, expert_idx=idx, gates=gates, aux_loss=zero_aux(x.device), stats=stats)

    def _selection_bias(self) -> Tensor | None:
        """The bias the limit selects with: training's, or in evaluation (EMA anchors) evaluation's."""
        if self.subtree_balance != "bias" or not self._limits():
            return None
        return self.eval_balance.balance_bias if self.balance_eval and not self.training else self.balance_bias

    @torch.no_grad()
    def _select_and_balance(self, f: Tensor, probs: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        """(training's selection [T, K], its load [E]) and one balance step from the hard loads (and for
        ``newton`` their slopes in the bias) of every replica, so the biases stay equal: training's bias
        from this batch's selections, evaluation's from those the EMA anchors would make of it. Both
        selections (and their slopes) in one pass, the loads and slopes summed in one collective."""
        newton, k, e = self.balance_rule == "newton", self.top_k, self.num_experts
        assert self.subtree_levels is not None  # balancing: a limit the layer resolved
        biases, masses = [self.balance_bias], [probs]
        if self.balance_eval:
            biases.append(self.eval_balance.balance_bias)
            masses.append(tree_probs(f.detach(), self.anchors))
        g = len(biases)
        idx, slope = limited_selection(torch.stack(masses), k, self.subtree_levels, torch.stack(biases), keep,
                                       slope=newton)
        # each selection's experts offset by E * its place: one count for all
        offset = torch.arange(g, device=idx.device).repeat_interleave(k) * e
        load = expert_load(idx.transpose(0, 1).reshape(-1, g * k) + offset, g * e, valid=keep).reshape(g, e)
        parts = load if slope is None else torch.cat([load, slope], 1)
        parts = self.reduce_stats(parts.reshape(-1)).reshape(g, -1)  # one collective for all
        stepped = torch.stack(biases)
        balance_step(stepped, parts[:, :e], self.subtree_levels, self.balance_rate, self.balance_rule,
                     parts[:, e:] if newton else None)
        for bias, new in zip(biases, stepped):
            bias.copy_(new)
        return idx[0], load[0]

    @torch.no_grad()
    def _update_anchors(self, stat: Tensor, mass: Tensor) -> None:
        """eq. 7 with the warmup cap; skip nodes whose pre-clamp arrival mass vanished.

        A batch that reaches no node at all (zero tokens on every replica) is not counted
        as a step, so the warmup cap still removes the initialisation bias afterwards.
        """
        ok = (mass > 0) & torch.isfinite(stat)
        # tensor arithmetic only (no host read on a GPU): a batch that reaches no node moves nothing
        self.ema_step += ok.any().long()
        t = self.ema_step.double().clamp_min(1)
        alpha = torch.clamp((t - 1) / t, max=self.ema_decay).to(self.anchors.dtype)
        new = alpha * self.anchors + (1 - alpha) * stat
        self.anchors.copy_(torch.where(ok, new, self.anchors))

    def extra_repr(self) -> str:
        limit = f", subtree_levels={self.subtree_levels}" if self.subtree_levels else ""
        if self.subtree_limit is not None:
            limit += f", subtree_balance={self.subtree_balance}"
            if self.subtree_balance == "bias":
                limit += (f", balance_rule={self.balance_rule}, balance_rate={self.balance_rate:g}, "
                          f"balance_eval={self.balance_eval}")
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, depth={self.depth}, "
            f"ema_decay={self.ema_decay}, eta={self.eta:g}{limit}"
        )


def _check_subtree_keys(limit, depth):
    if limit is None:
        if depth is not None:
            raise ValueError("router key 'subtree_depth' needs subtree_limit")
        return None, None
    if isinstance(limit, dict):
        if depth is not None:
            raise ValueError("router key 'subtree_depth' goes with an int subtree_limit, not a mapping by level")
        if not limit or any(not isinstance(k, str) for k in limit):
            raise ValueError(f"router key 'subtree_limit' as a mapping takes topology level names, got {limit!r}")
        for m in limit.values():
            if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 1:
                raise ValueError(f"router key 'subtree_limit' must give each level an int >= 1, got {limit!r}")
        return dict(limit), None
    if isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1:
        raise ValueError(f"router key 'subtree_limit' must be an int >= 1 or a mapping {{level: M}}, got {limit!r}")
    return int(limit), depth


def _check_balance(balance, limit) -> str:
    if balance is None:
        return DEFAULT_BALANCE if limit is not None else "none"
    if balance not in BALANCES:
        raise ValueError(f"router key 'subtree_balance' must be one of {', '.join(BALANCES)}, got {balance!r}")
    if balance != "none" and limit is None:
        raise ValueError(f"router key 'subtree_balance'={balance!r} balances a subtree limit: give subtree_limit")
    return balance


def _check_rule(rule) -> str:
    if rule is None:
        return DEFAULT_BALANCE_RULE
    if rule not in BALANCE_RULES:
        raise ValueError(f"router key 'balance_rule' must be one of {', '.join(BALANCE_RULES)}, got {rule!r}")
    return rule


def _check_rate(rate) -> float:
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"router key 'balance_rate' must be a number > 0, got {rate!r}")
    return float(rate)


class _EvalBias(torch.nn.Module):
    """Evaluation's selection bias, a child so that its state key ends in ``balance_bias``: a checkpoint
    saved before it loads it as zeros (``checkpoint.ADDED_SINCE``), which selects as it evaluated then."""

    balance_bias: Tensor

    def __init__(self, size: int):
        super().__init__()
        self.register_buffer("balance_bias", torch.zeros(size))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "balance_bias" not in state_dict:
            state_dict[prefix + "balance_bias"] = torch.zeros_like(self.balance_bias)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _node_level(levels: tuple) -> str:
    return "node" if "node" in levels else levels[max(len(levels) - 2, 0)]
