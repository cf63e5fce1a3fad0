"""GAR: gradient-aligned routing, an auxiliary objective for differentiable routers.

Li et al., "Routing in Gradient Space: Balanced Usage Is Not Expert Specialization",
section 5.2, Algorithm 1 (appendix G.1) and the factorized Gram
form of appendix G.2. For observation units m (same-task example groups by
default; examples or tokens as options, see ``gar_observe``):

  g_m      = sum_e grad_{theta_e} l_m  in a common parameter template, detached
  p_m      = the unit's router summary, recomputed from detached router inputs
             so only router parameters see the auxiliary gradient
  L_norm   = - sum_k ||sum_m p_mk g_m||^2 / (sum_m p_mk + eps)

Router parameters get grad(L_task + lambda L_norm); all other parameters get
grad(L_task); then one global-norm clip and one optimizer step.

Under expert parallelism (MoE layers with a process group) the observations of
all replicas enter one criterion: the m-th group of every rank is one group unit,
g_m sums the template gradients of every rank's experts, p_m averages every
rank's examples of the unit, and each rank backpropagates its share of the task
loss (w_m * its examples / all examples of the unit). The router gradients,
summed over the ranks (which the step does for every replicated parameter before
its global clip), equal one process running the union of the groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from dist_moe.dispatch.stats import all_reduce_sum
from dist_moe.routing.gar_factors import factor_gram, factor_observations
from dist_moe.routing.gar_observe import (
    MODES,
    UNITS,
    Observations,
    collect_observations,
    example_mean,
    example_sum,
    group_route_summaries,
    moe_layers,
    router_summary,
    template_gradient,
)

__all__ = [
    "GARConfig", "MODES", "UNITS", "Observations", "collect_observations", "equal_task_weights", "example_mean",
    "example_sum", "factor_gram", "moe_layers", "factor_observations", "gar_loss", "gar_loss_gram", "gar_objective",
    "gar_train_step", "group_route_summaries", "rank_local_param_ids", "router_summary", "sum_replicated_grads",
    "template_gradient", "clip_global",
]


@dataclass
class GARConfig:
    lam: float = 1e-3
    eps: float = 1e-8
    mode: str = "materialized"  # or "gram" (appendix G.2, no [M, d] observation matrix)
    unit: str = "group"  # observation unit: "group", "example" or "token"

    _KEYS = {"lambda": "lam", "eps": "eps", "mode": "mode", "unit": "unit"}

    @classmethod
    def from_dict(cls, d: dict) -> "GARConfig":
        if not isinstance(d, dict):
            raise ValueError(f"router key 'gar' must be a mapping, got {d!r}")
        unknown = sorted(set(d) - set(cls._KEYS))
        if unknown:
            raise ValueError(f"unknown gar key {unknown[0]!r}; valid keys: {sorted(cls._KEYS)}")
        cfg = cls(**{cls._KEYS[k]: v for k, v in d.items()})
        for key, value in (("lambda", cfg.lam), ("eps", cfg.eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"gar key {key!r} must be a finite number >= 0, got {value!r}")
        for key, value, allowed in (("mode", cfg.mode, MODES), ("unit", cfg.unit, UNITS)):
            if value not in allowed:
                raise ValueError(f"gar key {key!r} must be one of {list(allowed)}, got {value!r}")
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


def equal_task_weights(tasks: Sequence[int], sizes: Sequence[int]) -> list[float]:
    """w_m so that L_task = sum_m w_m l_m weighs tasks equally and examples equally within a task."""
    totals: dict[int, int] = {}
    for t, n in zip(tasks, sizes):
        totals[t] = totals.get(t, 0) + n
    return [n / totals[t] / len(totals) for t, n in zip(tasks, sizes)]


def gar_objective(obs: Observations, eps: float = 1e-8) -> Tensor:
    """L_norm summed over MoE layers (steps 6-7); differentiable in router parameters only."""
    total = torch.zeros((), device=obs.router_inputs[0][0][0].device)
    for li in range(len(obs.layers)):
        P = obs.route_summaries(li)
        if obs.G[li] is not None:
            total = total + gar_loss(P, obs.G[li], eps)
        else:
            total = total + gar_loss_gram(P, obs.W[li].to(P.dtype), eps)
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
    unit: str = "group",
    finish: Callable[[list, set, Any], None] | None = None,
) -> dict:
    """One GAR update (Algorithm 1).

    ``groups`` are the observation units (same-task example groups); ``loss_fn(model,
    group)`` runs the ordinary forward and returns the group's mean loss l_m;
    L_task = sum_m weights[m] l_m (see ``equal_task_weights``). Under expert
    parallelism also pass ``sizes`` (this rank's examples per group); the step then
    sums replicated parameters' gradients over the group and clips by the norm of
    every parameter on every rank. ``unit`` picks the observation unit ("group",
    "example", "token"); ``mode`` the materialized or the Gram form. ``finish(params,
    rank_local_ids, group)``, when given, replaces the gradient sum, clip and
    ``optimizer.step()`` (an engine that owns them, e.g. DeepSpeed).
    """
    optimizer.zero_grad(set_to_none=True)
    obs = collect_observations(model, groups, loss_fn, weights, mode, sizes, unit)
    aux = gar_objective(obs, eps)
    if lam and aux.requires_grad:
        # every rank holds the same L_norm: each contributes 1/W so the summed gradient is one L_norm's
        world = 1 if obs.group is None else torch.distributed.get_world_size(obs.group)
        (lam * aux / world).backward()  # router parameters only: inputs and observations are detached
    params = [p for p in model.parameters() if p.requires_grad]
    local = rank_local_param_ids(obs.layers)
    if finish is not None:
        finish(params, local, obs.group)
        return {"task_loss": obs.task_loss, "gar_loss": float(aux.detach()), "grad_norm": None}
    if obs.group is not None:
        sum_replicated_grads(params, local, obs.group)
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = clip_global(params, local, obs.group, max_grad_norm)
    optimizer.step()
    return {"task_loss": obs.task_loss, "gar_loss": float(aux.detach()), "grad_norm": grad_norm}


def rank_local_param_ids(sites) -> set[int]:
    """ids of the parameters each rank holds alone: its MoE layers' experts (``moe_layers(model)``)."""
    return {id(p) for site in sites for p in site.local_params}


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


def sum_replicated_grads(params, local_ids: set[int], group, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Data-parallel gradient sum of the parameters every rank holds (not those in ``local_ids``),
    flattened into buckets of about ``bucket_bytes``: one all-reduce per bucket, not per parameter."""
    replicated = [p for p in params if id(p) not in local_ids]
    for p in replicated:
        if p.grad is None:  # still take part: every rank reduces every replicated parameter
            p.grad = torch.zeros_like(p)
    bucket, size = [], 0
    for i, p in enumerate(replicated):
        bucket.append(p)
        size += p.grad.numel() * p.grad.element_size()
        last = i + 1 == len(replicated)
        if last or size >= bucket_bytes or (replicated[i + 1].grad.dtype, replicated[i + 1].grad.device) != (
                p.grad.dtype, p.grad.device):
            flat = all_reduce_sum(torch.cat([q.grad.reshape(-1) for q in bucket]), group)
            for q, part in zip(bucket, flat.split([q.grad.numel() for q in bucket])):
                q.grad.copy_(part.view_as(q.grad))
            bucket, size = [], 0


def clip_global(params, local_ids: set[int], group, max_norm: float) -> float:
    """One global-norm clip over all parameters; rank-local parameters' squares are summed over ranks."""
    with_grad = [p for p in params if p.grad is not None]
    if group is None:
        return float(torch.nn.utils.clip_grad_norm_(with_grad, max_norm))
    squares = torch.zeros(2, dtype=torch.float64, device=with_grad[0].grad.device if with_grad else None)
    for p in with_grad:  # [replicated, rank-local], summed on the gradients' device (no host read per tensor)
        squares[int(id(p) in local_ids)] += (p.grad.double() ** 2).sum()
    total = float(squares[0] + all_reduce_sum(squares[1:], group)[0]) ** 0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for p in with_grad:
            p.grad.mul_(coef)
    return total
