"""One GAR update (Algorithm 1): GAR's objective for differentiable routers, applied.

Li et al., "Routing in Gradient Space: Balanced Usage Is Not Expert Specialization",
section 5.2, Algorithm 1 (appendix G.1) and the factorized Gram
form of appendix G.2. For observation units m (same-task example groups by
default; examples or tokens as options, see ``dist_moe.gar.observe``):

  g_m      = sum_e grad_{theta_e} l_m  in a common parameter template, detached
  p_m      = the unit's router summary, recomputed from detached router inputs
             so only router parameters see the auxiliary gradient
  L_norm   = - sum_k ||sum_m p_mk g_m||^2 / (sum_m p_mk + eps)

Router parameters get grad(L_task + lambda L_norm); all other parameters get
grad(L_task); then one global-norm clip and one optimizer step, unless a loss or a gradient is not
finite on some rank: then no rank steps (the step is skipped, as a plain step is). With a ``share`` s
instead of a fixed lambda (an extension: ``train.gar.share``), lambda is set on every
step so that ||lambda grad_router L_norm|| = s ||grad_router L_task||, both measured on
this step's gradients (summed over the ranks under expert parallelism).

Under expert parallelism (MoE layers with a process group) the observations of
all replicas enter one criterion: the m-th group of every rank is one group unit,
g_m sums the template gradients of every rank's experts, p_m averages every
rank's examples of the unit, and each rank backpropagates its share of the task
loss (w_m * its examples / all examples of the unit). The router gradients,
summed over the ranks (which the step does for every replicated parameter before
its global clip), equal one process running the union of the groups.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dist_moe.distributed.reductions import all_reduce_sum_
from dist_moe.gar.observe import Observations, collect_observations
from dist_moe.routing.gar import GARConfig, gar_loss, gar_loss_gram
from dist_moe.train.step.grads import all_finite, clip_global, group_size, sum_replicated_grads


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
    sizes: Sequence[int] | None = None,
    finish: Callable[[list, set, Any], None] | None = None,
    **settings,
) -> dict:
    """One GAR update (Algorithm 1).

    ``groups`` are the observation units (same-task example groups); ``loss_fn(model,
    group)`` runs the ordinary forward and returns the group's mean loss l_m;
    L_task = sum_m weights[m] l_m (see ``equal_task_weights``). Under expert
    parallelism also pass ``sizes`` (this rank's examples per group); the step then
    sums replicated parameters' gradients over the group and clips by the norm of
    every parameter on every rank. ``finish(params, rank_local_ids, group)``, when given,
    replaces the gradient sum, clip and ``optimizer.step()`` (an engine that owns them,
    e.g. DeepSpeed). ``settings``: ``max_grad_norm`` (default 1.0; None: no clip) and GAR's
    own, as ``gar=GARConfig(...)`` or its fields: ``lam``, ``eps``, ``unit`` (the observation
    unit: "group", "example", "token"), ``mode`` (the materialized or the Gram form) and
    ``share`` (instead of ``lam``, the lambda that gives GAR that share of the router's
    gradient: ``share_lambda``).
    Returns the losses, lambda, the gradient norm and ``stepped``: False when a loss or a gradient
    was not finite on some rank, in which case no rank updated a parameter.
    """
    max_grad_norm = settings.pop("max_grad_norm", 1.0)
    gar = settings.pop("gar", None) or GARConfig(**settings)
    lam, share = gar.lam, gar.share
    optimizer.zero_grad(set_to_none=True)
    obs = collect_observations(model, groups, loss_fn, weights, gar.mode, sizes, gar.unit)
    aux = gar_objective(obs, gar.eps)
    world = group_size(obs.group)
    if share is not None:
        lam = share_lambda(aux, obs, share) if aux.requires_grad else 0.0
    elif lam and aux.requires_grad:
        # every rank holds the same L_norm: each contributes 1/W so the summed gradient is one L_norm's
        (lam * aux / world).backward()  # router parameters only: inputs and observations are detached
    params = [p for p in model.parameters() if p.requires_grad]
    local = rank_local_param_ids(obs.layers)
    out = {"task_loss": obs.task_loss, "gar_loss": float(aux.detach()), "grad_norm": None, "lambda": lam,
           "stepped": False}
    losses = torch.tensor([obs.task_loss, out["gar_loss"], lam], dtype=torch.float64)
    if finish is not None:  # the engine reduces: every rank's own gradients are checked before it does
        if _finite_or_cleared(losses, params, obs.group):
            finish(params, local, obs.group)
            out["stepped"] = True
        return out
    if obs.group is not None:
        sum_replicated_grads(params, local, obs.group)
    if not _finite_or_cleared(losses, params, obs.group):  # after the sum, which may overflow too
        return out
    if max_grad_norm is not None:
        out["grad_norm"] = clip_global(params, local, obs.group, max_grad_norm)
    optimizer.step()
    out["stepped"] = True
    return out


def _finite_or_cleared(losses: Tensor, params, group) -> bool:
    """Whether the losses, lambda and every gradient (L_norm's included) are finite on every rank;
    if not, the gradients are dropped so that nothing of the step reaches the optimizer."""
    if all_finite(losses, params, group):
        return True
    for p in params:
        p.grad = None
    return False


def router_parameters(obs: Observations) -> list[Tensor]:
    return [p for site in obs.layers for p in site.router.parameters() if p.requires_grad]


def share_lambda(aux: Tensor, obs: Observations, share: float) -> float:
    """Add lambda grad L_norm to the router parameters' gradients, with lambda such that its norm is
    ``share`` times the task gradient's already accumulated there; returns lambda (0 when L_norm has no
    gradient). Under expert parallelism both norms are of the gradients summed over the ranks (each
    rank holds a share of the task gradient and the same L_norm), so every rank finds the same lambda."""
    params = router_parameters(obs)
    grads = torch.autograd.grad(aux, params, allow_unused=True)

    def flat(gs) -> Tensor:
        return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(gs, params)])

    world = group_size(obs.group)
    both = torch.stack([flat([p.grad for p in params]), flat(grads) / world]).double()
    if obs.group is not None:
        all_reduce_sum_(both, obs.group)
    task_norm, gar_norm = both.norm(dim=1).tolist()
    lam = share * task_norm / gar_norm if gar_norm > 0 else 0.0
    for p, g in zip(params, grads):
        if g is not None:  # each rank adds 1/W of it: summed over the ranks, one lambda grad L_norm
            p.grad = g * (lam / world) if p.grad is None else p.grad + g * (lam / world)
    return lam


def rank_local_param_ids(sites) -> set[int]:
    """ids of the parameters each rank holds alone: its MoE layers' experts (``moe_views(model)``)."""
    return {id(p) for site in sites for p in site.local_params}
