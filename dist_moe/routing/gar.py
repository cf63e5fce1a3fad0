"""GAR's criterion, as pure tensor math: L_norm from routing rows and detached observations.

Li et al., "Routing in Gradient Space: Balanced Usage Is Not Expert Specialization",
section 5.2 (L_norm) and appendix G.2 (its Gram form). GAR is not a router: collecting
the observations and the training step that applies the criterion live in
``dist_moe.gar`` (they run backwards and collectives, which routing strategies never do).
"""
from __future__ import annotations

from torch import Tensor


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
