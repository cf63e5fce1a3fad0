"""GAR: gradient-aligned routing, an auxiliary objective for differentiable routers.

gar-paper.txt section 5.2, Algorithm 1 (appendix G.1) and the factorized Gram
form of appendix G.2. For observation units m (same-task example groups):

  g_m      = sum_e grad_{theta_e} l_m  in a common parameter template, detached
  p_m      = mean of the units' router summaries, recomputed from detached
             router inputs so only router parameters see the auxiliary gradient
  L_norm   = - sum_k ||sum_m p_mk g_m||^2 / (sum_m p_mk + eps)

Router parameters get grad(L_task + lambda L_norm); all other parameters get
grad(L_task); then one global-norm clip and one optimizer step.

Under expert parallelism (MoE layers with a process group) every rank takes the
same number of groups, and the m-th group of every rank together form
observation unit m, so the observations of all replicas enter one criterion:
g_m sums the template gradients of every rank's experts (an all-reduce), p_m
averages every rank's examples of the unit, and each rank backpropagates its
share of the task loss (w_m * its examples / all examples of the unit). The
router gradients, summed over the ranks (which the step does for every
replicated parameter before its global clip), equal one process running the
union of the groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from dist_moe.dispatch.stats import all_reduce_sum


@dataclass
class GARConfig:
    lam: float = 1e-3
    eps: float = 1e-8
    mode: str = "materialized"  # or "gram" (appendix G.2, no [M, d] observation matrix)

    @classmethod
    def from_dict(cls, d: dict) -> "GARConfig":
        if not isinstance(d, dict):
            raise ValueError(f"router key 'gar' must be a mapping, got {d!r}")
        unknown = sorted(set(d) - {"lambda", "eps", "mode"})
        if unknown:
            raise ValueError(f"unknown gar key {unknown[0]!r}; valid keys: ['eps', 'lambda', 'mode']")
        cfg = cls(lam=d.get("lambda", cls.lam), eps=d.get("eps", cls.eps), mode=d.get("mode", cls.mode))
        if isinstance(cfg.lam, bool) or not isinstance(cfg.lam, (int, float)) or cfg.lam < 0:
            raise ValueError(f"gar key 'lambda' must be a number >= 0, got {cfg.lam!r}")
        if isinstance(cfg.eps, bool) or not isinstance(cfg.eps, (int, float)) or cfg.eps < 0:
            raise ValueError(f"gar key 'eps' must be a number >= 0, got {cfg.eps!r}")
        if cfg.mode not in ("materialized", "gram"):
            raise ValueError(f"gar key 'mode' must be 'materialized' or 'gram', got {cfg.mode!r}")
        return cfg


def gar_loss(P: Tensor, G: Tensor, eps: float = 1e-8) -> Tensor:
    """- sum_k ||sum_m P[m,k] G[m]||^2 / (sum_m P[m,k] + eps);  P [M, K], G [M, d] (detached)."""
    if P.dim() != 2 or G.dim() != 2 or P.shape[0] != G.shape[0]:
        raise ValueError(f"gar_loss needs P [M, K] and G [M, d] with equal M, got {tuple(P.shape)}, {tuple(G.shape)}")
    agg = P.t() @ G.detach().to(P.dtype)  # [K, d] surrogate aggregates G_k
    return -((agg * agg).sum(1) / (P.sum(0) + eps)).sum()


def gar_loss_gram(P: Tensor, W: Tensor, eps: float = 1e-8) -> Tensor:
    """The same objective from the detached Gram matrix W [M, M]: - sum_k [P^T W P]_kk / (d_k + eps)."""
    if W.shape != (P.shape[0], P.shape[0]):
        raise ValueError(f"gar_loss_gram needs W [M, M] with M={P.shape[0]}, got {tuple(W.shape)}")
    quad = ((W.detach().to(P.dtype) @ P) * P).sum(0)  # diag(P^T W P)
    return -(quad / (P.sum(0) + eps)).sum()


def router_summary(routing) -> Tensor:
    """Per-token configured gate distribution [T, E]: selected gates renormalised to sum 1.

    With one expert per token that distribution is one-hot and has no gradient; as in
    the paper's top-1 extension (appendix D.4) its derivative is then the full
    distribution's (straight-through): value one-hot, gradient d probs.
    """
    dense = routing.dense_gates()
    summary = dense / dense.sum(1, keepdim=True).clamp_min(torch.finfo(dense.dtype).tiny)
    if routing.expert_idx.shape[1] == 1:
        summary = summary.detach() + routing.probs - routing.probs.detach()
    return summary


def template_gradient(experts) -> Tensor:
    """Flattened sum over experts of each stacked parameter's gradient (one slot per parameter)."""
    parts = []
    for p in experts.template().values():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        parts.append(g.sum(0).flatten())
    return torch.cat(parts)


def _stash_grads(params: list) -> list:
    """Take the accumulated gradients out (so the next backward writes one group's alone)."""
    stash = [p.grad for p in params]
    for p in params:
        p.grad = None
    return stash


def _restore_grads(params: list, stash: list) -> None:
    for p, g in zip(params, stash):
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g


def factor_gram(captures: Sequence, scales: Sequence[float]) -> Tensor:
    """Exact Gram W_ij = <g_i, g_j> from per-group block inputs x and output gradients delta.

    For slot b: v_mb = sum_{rows r of m} delta_r x_r^T, so <v_ib, v_jb> = sum_{r in i, r' in j}
    <delta_r, delta_r'> <x_r, x_r'>; rows of every expert using slot b enter the same sum.
    """
    m = len(captures)
    device = next((x.device for c in captures for xs in c.inputs.values() for x in xs), torch.device("cpu"))
    W = torch.zeros(m, m, dtype=torch.float64, device=device)
    slots = {s for c in captures for s in c.inputs}
    for slot in sorted(slots):
        xs, ds, owner = [], [], []
        for i, (cap, scale) in enumerate(zip(captures, scales)):
            for x, d in zip(cap.inputs.get(slot, []), cap.grads.get(slot, [])):
                if d is None:  # block output received no gradient
                    continue
                xs.append(x.double())
                ds.append(d.double() / scale)
                owner.append(torch.full((x.shape[0],), i, dtype=torch.long, device=device))
        if not xs:
            continue
        X, D, own = torch.cat(xs), torch.cat(ds), torch.cat(owner)
        K = (D @ D.t()) * (X @ X.t())  # [R, R] over routed rows: memory grows with R^2, not with d
        S = torch.nn.functional.one_hot(own, m).double()
        W += S.t() @ K @ S
    return W


def equal_task_weights(tasks: Sequence[int], sizes: Sequence[int]) -> list[float]:
    """w_m so that L_task = sum_m w_m l_m weighs tasks equally and examples equally within a task."""
    totals: dict[int, int] = {}
    for t, n in zip(tasks, sizes):
        totals[t] = totals.get(t, 0) + n
    return [n / totals[t] / len(totals) for t, n in zip(tasks, sizes)]


def moe_layers(model: nn.Module) -> list:
    from dist_moe.layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def expert_parallel_group(layers):
    """The process group the MoE layers dispatch over, or None when they all run locally."""
    groups = {id(layer.group): layer.group for layer in layers if layer.dispatcher is not None}
    if not groups:
        return None
    if len(groups) > 1 or any(layer.dispatcher is None for layer in layers):
        raise ValueError("GAR needs every MoE layer on the same expert-parallel group")
    return next(iter(groups.values()))


@dataclass
class Observations:
    """What one GAR update collects per MoE layer during task-gradient accumulation."""

    layers: list
    router_inputs: list  # [layer][group] -> (detached router input [T, H], extras for the router call)
    per_group: list  # [layer][group] -> g_m [d] (materialized) or FactorCapture (gram)
    task_loss: float
    mode: str
    weights: Sequence[float]
    group: object = None  # the expert-parallel process group, if any


def collect_observations(model, groups, loss_fn, weights, mode="materialized", sizes=None) -> Observations:
    """Accumulate grad(L_task), L_task = sum_m w_m l_m, one group at a time (steps 1-3).

    g_m is read off the accumulation: each group's backward writes its expert gradients
    alone (the running sum is stashed and added back after), which gives w_m grad l_m
    exactly; divided by w_m and summed over experts in the template.
    """
    from dist_moe.experts import FactorCapture

    if mode not in ("materialized", "gram"):
        raise ValueError(f"mode must be 'materialized' or 'gram', got {mode!r}")
    if len(weights) != len(groups) or not groups:
        raise ValueError(f"need one weight per group: {len(weights)} weights for {len(groups)} groups")
    if any(not w > 0 for w in weights):
        raise ValueError(f"group weights must be > 0, got {list(weights)}")
    layers = moe_layers(model)
    if not layers:
        raise ValueError("GAR found no MoELayer in the model")
    ep = expert_parallel_group(layers)
    shares = list(weights)
    if ep is not None:
        if mode == "gram":
            raise NotImplementedError("GAR's gram mode is not available under expert parallelism yet; "
                                      "use mode='materialized'")
        if sizes is None or len(sizes) != len(groups) or any(int(n) < 1 for n in sizes):
            raise ValueError("under expert parallelism pass sizes=[examples of each group on this rank], "
                             f"each >= 1 (got {sizes!r})")
        totals = all_reduce_sum(torch.tensor([float(n) for n in sizes], dtype=torch.float64), ep).tolist()
        shares = [w * n / total for w, n, total in zip(weights, sizes, totals)]
    inputs = [[] for _ in layers]
    per_group = [[] for _ in layers]
    task_loss = 0.0
    template = [list(layer.experts.template().values()) for layer in layers]
    for group, w, share in zip(groups, weights, shares):
        if mode == "materialized":
            stashes = [_stash_grads(params) for params in template]
        else:
            for layer in layers:
                layer.experts.capture = FactorCapture()
        try:
            loss = loss_fn(model, group)
            (share * loss).backward()
        finally:
            captures = [layer.experts.capture for layer in layers]
            for layer in layers:
                layer.experts.capture = None
        task_loss += share * float(loss.detach())
        for li, layer in enumerate(layers):
            inputs[li].append((layer.last_router_input, dict(layer.last_router_extras), layer.last_token_layout))
            if mode == "materialized":
                per_group[li].append(template_gradient(layer.experts) / w)
                _restore_grads(template[li], stashes[li])
            else:
                per_group[li].append(captures[li])
    if ep is not None:
        task_loss = float(all_reduce_sum(torch.tensor(task_loss, dtype=torch.float64), ep))
        # every rank's experts enter the template sum: one all-reduce per layer (EP is materialized only)
        per_group = [list(all_reduce_sum(torch.stack(rows), ep).unbind(0)) for rows in per_group]
    return Observations(layers, inputs, per_group, task_loss, mode, list(weights), ep)


def example_sum(summary: Tensor, layout) -> tuple[Tensor, int]:
    """(sum over examples of q_n, number of examples): q_n averages an example's valid tokens.

    ``layout`` is (leading shape, padding mask or None) as the MoE layer saw the input:
    [B] means one token per example, [B, S] means S token positions per example.
    """
    shape, padding = layout
    if len(shape) <= 1:
        return summary.sum(0), summary.shape[0]
    q = summary.reshape(shape[0], -1, summary.shape[-1])
    if padding is None:
        return q.mean(1).sum(0), shape[0]
    valid = (~padding.reshape(shape[0], -1)).to(q.dtype).unsqueeze(-1)
    per_example = (q * valid).sum(1) / valid.sum(1).clamp_min(1)
    keep = valid.sum((1, 2)) > 0  # a fully padded example is no example
    return per_example[keep].sum(0), int(keep.sum())


def example_mean(summary: Tensor, layout) -> Tensor:
    """p_m: average each example's valid tokens (q_n), then average the examples (step 5)."""
    total, count = example_sum(summary, layout)
    return total / count


def group_route_summaries(router, router_inputs, group=None) -> Tensor:
    """P [M, E]: per unit, the router summary recomputed from detached inputs (steps 4-5).

    The recomputation runs the router in its training mode, so a Switch router's input
    jitter is drawn afresh here (the configured rule, not the forward's exact noise).
    With a process group the unit's examples on every rank are averaged together.
    """
    with router.frozen_state():  # recomputation must not move anchors, biases or schedules again
        parts = [example_sum(router_summary(router(h, **extras)), layout) for h, extras, layout in router_inputs]
    sums = torch.stack([s for s, _ in parts])
    counts = torch.tensor([float(c) for _, c in parts], dtype=sums.dtype, device=sums.device)
    return all_reduce_sum(sums, group) / all_reduce_sum(counts, group).unsqueeze(1)


def gar_objective(obs: Observations, eps: float = 1e-8) -> Tensor:
    """L_norm summed over MoE layers (steps 6-7); differentiable in router parameters only."""
    total = torch.zeros((), device=obs.router_inputs[0][0][0].device)
    for li, layer in enumerate(obs.layers):
        P = group_route_summaries(layer.router, obs.router_inputs[li], obs.group)
        if obs.mode == "materialized":
            total = total + gar_loss(P, torch.stack(obs.per_group[li]), eps)
        else:
            total = total + gar_loss_gram(P, factor_gram(obs.per_group[li], obs.weights).to(P.dtype), eps)
    return total


def gar_train_step(
    model: nn.Module,
    groups: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], Tensor],
    optimizer: torch.optim.Optimizer,
    weights: Sequence[float],
    lam: float,
    eps: float = 1e-8,
    max_grad_norm: float | None = 1.0,
    mode: str = "materialized",
    sizes: Sequence[int] | None = None,
) -> dict:
    """One GAR update (Algorithm 1).

    ``groups`` are the observation units (same-task example groups); ``loss_fn(model,
    group)`` runs the ordinary forward and returns the group's mean loss l_m;
    L_task = sum_m weights[m] l_m (see ``equal_task_weights``). Under expert
    parallelism also pass ``sizes`` (this rank's examples per group); the step then
    sums replicated parameters' gradients over the group and clips by the norm of
    every parameter on every rank.
    """
    optimizer.zero_grad(set_to_none=True)
    obs = collect_observations(model, groups, loss_fn, weights, mode, sizes)
    aux = gar_objective(obs, eps)
    if lam and aux.requires_grad:
        # every rank holds the same L_norm: each contributes 1/W so the summed gradient is one L_norm's
        world = 1 if obs.group is None else torch.distributed.get_world_size(obs.group)
        (lam * aux / world).backward()  # router parameters only: inputs and observations are detached
    params = [p for p in model.parameters() if p.requires_grad]
    if obs.group is not None:
        sum_replicated_grads(params, obs.layers, obs.group)
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = _clip_global(params, obs.layers, obs.group, max_grad_norm)
    optimizer.step()
    return {"task_loss": obs.task_loss, "gar_loss": float(aux.detach()), "grad_norm": grad_norm}


def _expert_param_ids(layers) -> set[int]:
    return {id(p) for layer in layers for p in layer.experts.parameters()}


def sum_replicated_grads(params, layers, group) -> None:
    """Data-parallel gradient sum of the parameters every rank holds (experts are rank-local)."""
    local = _expert_param_ids(layers)
    for p in params:
        if id(p) in local:
            continue
        if p.grad is None:  # still take part: every rank reduces every replicated parameter
            p.grad = torch.zeros_like(p)
        p.grad = all_reduce_sum(p.grad, group)


def _clip_global(params, layers, group, max_norm: float) -> float:
    """One global-norm clip over all parameters; rank-local experts' squares are summed over ranks."""
    with_grad = [p for p in params if p.grad is not None]
    if group is None:
        return float(torch.nn.utils.clip_grad_norm_(with_grad, max_norm))
    local = _expert_param_ids(layers)
    squares = torch.zeros(2, dtype=torch.float64)  # [replicated, rank-local experts]
    for p in with_grad:
        squares[int(id(p) in local)] += (p.grad.double() ** 2).sum()
    total = float(squares[0] + all_reduce_sum(squares[1:], group)[0]) ** 0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for p in with_grad:
            p.grad.mul_(coef)
    return total
