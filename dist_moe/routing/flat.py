"""Flat baselines (BRANCH paper appendix B.2).

switch       softmax top-K, multiplicative input jitter in training, Switch
             load-balancing loss  coeff * E * sum_e f_e P_e, optional capacity;
             gates are the raw softmax probabilities (Switch's top-1 convention)
             unless normalize_gates renormalises them over the top-K
deepseek_v3  sigmoid (or softmax) affinities; a non-trainable bias enters the
             top-K selection only and moves by +-gamma toward balance after
             every training forward (once per micro-batch under gradient
             accumulation); gates from the unbiased affinities
skywork      gating-logit normalisation (z - mean) / std * scale before softmax,
             plus the Switch auxiliary loss
hash         fixed avalanche hash of a token id (position when there is none)
uniform      equal weights over all experts (dense)
"""
from __future__ import annotations

import torch
from torch import Tensor

from dist_moe.routing.base import Router, Routing, expert_load, pick, select_top_k, zero_aux
from dist_moe.routing.capacity import capacity_for, capacity_step
from dist_moe.routing.hashing import hash_combine
from dist_moe.routing.node_map import NodeMap


def switch_aux_loss(probs: Tensor, expert_idx: Tensor, coeff: float, valid: Tensor | None = None) -> Tensor:
    """coeff * E * sum_e f_e * P_e; f_e = share of the T*K selections, P_e = mean probability, both over
    the ``valid`` tokens only (Megatron's switch_load_balancing_loss_func with its padding mask)."""
    e = probs.shape[1]
    load = expert_load(expert_idx, e, valid=valid)
    f = load / load.sum().clamp_min(1)
    if valid is None:
        mean_prob = probs.sum(0) / max(probs.shape[0], 1)  # a rank with no tokens adds 0, not NaN
    else:
        mean_prob = (probs * valid.unsqueeze(1)).sum(0) / valid.sum().clamp_min(1)
    return coeff * e * (f.to(probs.dtype) * mean_prob).sum()


class _LearnedFlatRouter(Router):
    """Shared parts of switch / skywork / deepseek_v3: a logit map over the experts, and
    node-limited routing (DeepSeek-V3's node-limited / Megatron's group-limited routing):
    with ``node_limit=M`` each token's top-K comes from its best M expert groups, where a
    group is the experts of one node under the active placement (set by MoELayer) and a
    group's score is the sum of its ceil(K/M) highest selection scores.
    """

    group_members: Tensor | None  # a buffer: each node's experts, when node-limited

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, node_map: str = "linear",
                 mlp_hidden: int | None = None, node_limit: int | None = None, stats_group=None):
        super().__init__(num_experts, top_k, stats_group)
        if node_limit is not None and (not isinstance(node_limit, int) or node_limit < 1):
            raise ValueError(f"node_limit must be a positive int or None, got {node_limit!r}")
        self.hidden_size = hidden_size
        self.node_limit = node_limit
        self.node_map = NodeMap(hidden_size, num_experts, node_map, mlp_hidden)
        # [G, E/G] expert ids per group; a buffer so that .to(device) moves it, not saved with the weights
        self.register_buffer("group_members", None, persistent=False)

    def set_expert_groups(self, expert_group: Tensor) -> None:
        """expert_group [E]: the group (node) of each expert; groups must be equally sized."""
        expert_group = torch.as_tensor(expert_group, dtype=torch.long)
        if expert_group.shape != (self.num_experts,):
            raise ValueError(f"expert_group must have {self.num_experts} entries, got {tuple(expert_group.shape)}")
        counts = torch.bincount(expert_group)
        if (counts != counts[0]).any():
            raise ValueError(f"expert groups must be equally sized, got sizes {counts.tolist()}")
        if self.node_limit is not None and self.node_limit > len(counts):
            raise ValueError(f"router key 'node_limit' is {self.node_limit}, but the experts sit on {len(counts)} "
                             f"node(s): a limit of more nodes than there are limits nothing; give at most "
                             f"{len(counts)}")
        if self.node_limit is not None and self.top_k > self.node_limit * int(counts[0]):
            raise ValueError(f"top_k={self.top_k} cannot fit in node_limit={self.node_limit} groups of "
                             f"{int(counts[0])}")
        members = torch.argsort(expert_group, stable=True).reshape(len(counts), -1)
        self.group_members = members.to(self.node_map.parameters().__next__().device)

    def limit_to_groups(self, scores: Tensor) -> Tensor:
        """Selection scores with every expert outside the token's best node_limit groups at -inf."""
        if self.node_limit is None:
            return scores
        if self.group_members is None:
            raise ValueError("node_limit needs expert groups: build the router in an MoELayer with a placement "
                             "and topology, or call set_expert_groups")
        members = self.group_members
        g, size = members.shape
        if self.node_limit >= g:
            return scores
        per_group = scores[:, members]  # [T, G, size]
        take = min(-(-self.top_k // self.node_limit), size)
        group_score = per_group.topk(take, dim=-1).values.sum(-1)
        best = group_score.topk(self.node_limit, dim=-1).indices  # [T, M]
        allowed_group = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, best, True)
        allowed = torch.zeros_like(scores, dtype=torch.bool)
        allowed[:, members.reshape(-1)] = allowed_group.repeat_interleave(size, dim=1)
        return scores.masked_fill(~allowed, float("-inf"))


class SwitchRouter(_LearnedFlatRouter):
    """Switch Transformer routing (Fedus et al. 2022): softmax over the experts, top-K, the load-balancing
    auxiliary loss; the flat baseline."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int = 1,
        node_map: str = "linear",
        mlp_hidden: int | None = None,
        aux_loss_coeff: float = 0.01,
        jitter_eps: float = 0.01,
        capacity_factor: float | None = None,
        normalize_gates: bool = False,
        node_limit: int | None = None,
        stats_group=None,
    ):
        super().__init__(hidden_size, num_experts, top_k, node_map, mlp_hidden, node_limit, stats_group)
        if not 0.0 <= jitter_eps < 1.0:
            raise ValueError(f"jitter_eps must lie in [0, 1), got {jitter_eps!r}")
        if not 0.0 <= aux_loss_coeff < float("inf"):
            raise ValueError(f"aux_loss_coeff must be a finite number >= 0, got {aux_loss_coeff!r}")
        if capacity_factor is not None:
            capacity_for(1, top_k, num_experts, capacity_factor)  # validates
        self.aux_loss_coeff = float(aux_loss_coeff)
        self.jitter_eps = float(jitter_eps)
        self.capacity_factor = capacity_factor
        self.normalize_gates = bool(normalize_gates)

    def logits(self, x: Tensor) -> Tensor:
        if self.training and self.jitter_eps > 0:
            x = x * torch.empty_like(x).uniform_(1 - self.jitter_eps, 1 + self.jitter_eps)
        return self.node_map(x)

    def forward(self, x: Tensor, categories: Tensor | None = None, token_ids: Tensor | None = None,
                valid: Tensor | None = None) -> Routing:
        x = self.check_input(x, self.hidden_size)
        keep = self.check_valid(valid, x.shape[0])
        probs = torch.softmax(self.logits(x), dim=-1)
        _, idx = select_top_k(self.limit_to_groups(probs.detach()), self.top_k)
        vals = pick(probs, idx)
        gates = vals / vals.sum(1, keepdim=True) if self.normalize_gates else vals
        aux = switch_aux_loss(probs, idx, self.aux_loss_coeff, keep)
        stats: dict = {}
        idx, gates = capacity_step(idx, gates, self.num_experts, self.capacity_factor, stats)
        stats["load"] = expert_load(idx, self.num_experts, valid=keep)
        return Routing(probs=probs, expert_idx=idx, gates=gates, aux_loss=aux, stats=stats)


class SkyworkRouter(SwitchRouter):
    """Switch with gating-logit normalisation (Skywork-MoE, Wei et al. 2024).

    Input jitter defaults to off: BRANCH appendix B.2 specifies it for Switch only.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int = 1, norm_scale: float = 1.0,
                 jitter_eps: float = 0.0, **kw):
        super().__init__(hidden_size, num_experts, top_k, jitter_eps=jitter_eps, **kw)
        if not norm_scale > 0:
            raise ValueError(f"norm_scale must be > 0, got {norm_scale!r}")
        self.norm_scale = float(norm_scale)

    def logits(self, x: Tensor) -> Tensor:
        z = super().logits(x)
        if z.shape[0] == 0:
            return z
        std = z.std(dim=-1, keepdim=True, unbiased=False).clamp_min(1e-6)
        return self.norm_scale * (z - z.mean(dim=-1, keepdim=True)) / std


class DeepSeekV3Router(_LearnedFlatRouter):
    """DeepSeek-V3 routing: sigmoid scores, top-K chosen with a per-expert bias that an update rule moves
    towards balance (no auxiliary loss); ``node_limit`` for its node-limited form."""

    expert_bias: Tensor  # a buffer

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int = 1,
        node_map: str = "linear",
        mlp_hidden: int | None = None,
        score_func: str = "sigmoid",
        bias_update_rate: float = 1e-3,
        normalize_gates: bool | None = None,
        node_limit: int | None = None,
        stats_group=None,
    ):
        super().__init__(hidden_size, num_experts, top_k, node_map, mlp_hidden, node_limit, stats_group)
        if score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"score_func must be 'sigmoid' or 'softmax', got {score_func!r}")
        if not bias_update_rate >= 0:
            raise ValueError(f"bias_update_rate must be >= 0, got {bias_update_rate!r}")
        self.score_func = score_func
        self.bias_update_rate = float(bias_update_rate)
        # DeepSeek-V3 normalises the selected sigmoid affinities to sum to one; Megatron-core
        # 0.16.1 (topk_routing_with_score_function) only when top_k > 1: one normalised gate is
        # always 1.0, which would leave the router without a gradient.
        if normalize_gates is None:
            normalize_gates = score_func == "sigmoid" and self.top_k > 1
        self.normalize_gates = bool(normalize_gates)
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x: Tensor, categories: Tensor | None = None, token_ids: Tensor | None = None,
                valid: Tensor | None = None) -> Routing:
        x = self.check_input(x, self.hidden_size)
        keep = self.check_valid(valid, x.shape[0])
        logits = self.node_map(x)
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
        biased = scores.detach() + self.expert_bias  # the bias enters the selection only
        _, chosen = select_top_k(self.limit_to_groups(biased), self.top_k)
        # report the chosen set in order of the unbiased affinity (highest probability first)
        order = torch.sort(scores.detach().gather(1, chosen), dim=1, descending=True, stable=True).indices
        idx = chosen.gather(1, order)
        vals = pick(scores, idx)
        gates = vals / vals.sum(1, keepdim=True).clamp_min(1e-20) if self.normalize_gates else vals
        load = expert_load(idx, self.num_experts, valid=keep)  # padding does not move the biases
        if self.updates_state and self.bias_update_rate > 0:
            global_load = self.reduce_stats(load)
            # underloaded experts (load < mean) move up by gamma, overloaded down
            self.expert_bias += self.bias_update_rate * torch.sign(global_load.mean() - global_load)
        probs = scores / scores.sum(1, keepdim=True) if self.score_func == "sigmoid" else scores
        stats = {"load": load, "dropped": 0}
        return Routing(probs=probs, expert_idx=idx, gates=gates, aux_loss=zero_aux(x.device), stats=stats)


class HashRouter(Router):
    """Hash Layers (Roller et al. 2021): K distinct experts from a fixed hash of the token id."""

    inputs = frozenset({"token_ids"})

    def __init__(self, num_experts: int, top_k: int = 1, seed: int = 0, hidden_size: int | None = None):
        super().__init__(num_experts, top_k)
        self.hidden_size = hidden_size
        self.seed = int(seed)

    def forward(self, x: Tensor, categories: Tensor | None = None, token_ids: Tensor | None = None,
                valid: Tensor | None = None) -> Routing:
        x = self.check_input(x, self.hidden_size)
        t = x.shape[0]
        if token_ids is None:
            token_ids = torch.arange(t, device=x.device)  # fall back to the position
        elif token_ids.shape != (t,) or token_ids.is_floating_point():
            raise ValueError(f"token_ids must be an integer tensor of shape [T]=[{t}], got "
                             f"{token_ids.dtype} {tuple(token_ids.shape)}")
        experts = torch.arange(self.num_experts, device=x.device)
        # a hashed score per (token, expert); the K largest give a uniform random K-subset
        score = hash_combine(self.seed, token_ids.long().unsqueeze(1), experts.unsqueeze(0))
        _, idx = select_top_k(score.double(), self.top_k)
        gates = x.new_full((t, self.top_k), 1.0 / self.top_k)
        probs = x.new_zeros(t, self.num_experts).scatter(1, idx, gates)
        stats = {"load": expert_load(idx, self.num_experts, valid=self.check_valid(valid, t)), "dropped": 0}
        return Routing(probs=probs, expert_idx=idx, gates=gates, aux_loss=zero_aux(x.device), stats=stats)


class UniformRouter(Router):
    """Every expert with weight 1/E (the No-Routing control)."""

    def __init__(self, num_experts: int, top_k: int | None = None, hidden_size: int | None = None):
        top_k = num_experts if top_k is None else top_k
        if top_k != num_experts:
            raise ValueError(f"top_k must equal num_experts={num_experts} (uniform routing is dense), got {top_k!r}")
        super().__init__(num_experts, top_k)
        self.hidden_size = hidden_size

    def forward(self, x: Tensor, categories: Tensor | None = None, token_ids: Tensor | None = None,
                valid: Tensor | None = None) -> Routing:
        x = self.check_input(x, self.hidden_size)
        t, e = x.shape[0], self.num_experts
        probs = x.new_full((t, e), 1.0 / e)
        idx = torch.arange(e, device=x.device).expand(t, e).contiguous()
        stats = {"load": expert_load(idx, e, valid=self.check_valid(valid, t)), "dropped": 0}
        return Routing(probs=probs, expert_idx=idx, gates=probs.clone(), aux_loss=zero_aux(x.device), stats=stats)
