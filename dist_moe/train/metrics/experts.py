"""Expert-usage and specialization metrics of the GAR paper (appendix E).

All of them are functions of small count or load tensors, so under data or
expert parallelism the inputs (loads, contingency tables, per-task expert
gradients) are summed over ranks first and the metric is computed once.

load vector     l_e: per-example router mass (FFN routing) or normalised selection
                counts (head routing), summing to 1
LVar            (1/E) sum_e (l_e - 1/E)^2, the population variance of the loads
utilization     share of experts with l_e >= 1/(2E)
gradient purity mean over experts of max_t ||g_te|| / sum_t ||g_te|| (0 for an
                expert whose gradient mass is at most 1e-12)
NMI, ARI        task-expert association from the contingency table C[t, e] of
                top-k selection events (arithmetic-normalised MI; Hubert-Arabie ARI)
structure purity sum_e max_t C[t, e] / sum C
routing entropy mean over examples of -sum_e p_ne log p_ne
"""
from __future__ import annotations

import torch
from torch import Tensor


def _load_distribution(load: Tensor) -> Tensor:
    load = load.double()
    total = load.sum()
    if not total > 0:
        raise ValueError("the load vector has no mass")
    return load / total


def lvar(load: Tensor) -> float:
    share = _load_distribution(load)
    return float(((share - 1.0 / share.numel()) ** 2).mean())


def utilization(load: Tensor) -> float:
    share = _load_distribution(load)
    return float((share >= 1.0 / (2 * share.numel())).double().mean())


def gradient_mass_purity(task_expert_grads: Tensor, floor: float = 1e-12) -> float:
    """task_expert_grads [T, E, d] (or norms [T, E]): detached per-task gradient observations per expert."""
    norms = task_expert_grads.double()
    if norms.dim() == 3:
        norms = norms.norm(dim=-1)
    if norms.dim() != 2:
        raise ValueError(f"expected [T, E, d] gradients or [T, E] norms, got shape {tuple(task_expert_grads.shape)}")
    mass = norms.sum(0)
    share = norms.max(0).values / mass.clamp_min(floor)
    return float(torch.where(mass > floor, share, torch.zeros_like(share)).mean())


def contingency(tasks: Tensor, expert_idx: Tensor, num_tasks: int, num_experts: int) -> Tensor:
    """C[t, e]: selection events of expert e by routed units of task t (dropped slots, -1, left out)."""
    if tasks.shape != expert_idx.shape[:1]:
        raise ValueError(f"tasks [{tasks.shape}] must give one task per routed unit of expert_idx {expert_idx.shape}")
    t = tasks.long().unsqueeze(1).expand_as(expert_idx)
    kept = expert_idx >= 0
    flat = t[kept] * num_experts + expert_idx[kept]
    return torch.bincount(flat, minlength=num_tasks * num_experts).reshape(num_tasks, num_experts).double()


def _entropy(p: Tensor) -> Tensor:
    p = p[p > 0]
    return -(p * p.log()).sum()


def nmi(c: Tensor) -> float:
    """Arithmetic-normalised mutual information of a contingency table (zero cells omitted)."""
    q = c.double() / c.sum()
    qt, qe = q.sum(1, keepdim=True), q.sum(0, keepdim=True)
    nz = q > 0
    mi = (q[nz] * (q[nz] / (qt * qe)[nz]).log()).sum()
    denom = 0.5 * (_entropy(qt.flatten()) + _entropy(qe.flatten()))
    return float(mi / denom) if denom > 0 else 0.0


def ari(c: Tensor) -> float:
    """Adjusted Rand index from a contingency table (Hubert & Arabie, 1985)."""
    c = c.double()

    def pairs(x: Tensor) -> Tensor:
        return (x * (x - 1) / 2).sum()

    index, rows, cols, n = pairs(c), pairs(c.sum(1)), pairs(c.sum(0)), float(c.sum())
    expected = rows * cols / (n * (n - 1) / 2)
    maximum = (rows + cols) / 2
    return float((index - expected) / (maximum - expected)) if maximum != expected else 1.0


def structure_purity(c: Tensor) -> float:
    return float(c.max(0).values.sum() / c.sum())


def routing_entropy(probs: Tensor) -> float:
    """Mean over routed units of the entropy of their [E] routing distribution."""
    p = probs.double().clamp_min(0)
    return float(-(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(1).mean())
