"""GAR's criterion, as pure tensor math: L_norm from routing rows and detached observations.

Li et al., "Routing in Gradient Space: Balanced Usage Is Not Expert Specialization",
section 5.2 (L_norm) and appendix G.2 (its Gram form), and GAR's settings (``GARConfig``: a
training config's ``train.gar``). GAR is not a router: collecting the observations and the training
step that applies the criterion live in ``dist_moe.gar`` (they run backwards and collectives, which
routing strategies never do).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from dist_moe.config.types import fits, hints, wanted
from dist_moe.errors import shown

UNITS = ("group", "example", "token")  # observation units (section 5.2, appendix G.2)
MODES = ("materialized", "gram")  # the [M, d] observations, or their Gram matrix (appendix G.2)
# GAR needs router probabilities that depend differentiably on router parameters.
DIFFERENTIABLE = ("switch", "deepseek_v3", "skywork", "branch")


@dataclass(frozen=True)
class GARConfig:
    """GAR's settings: a training config's ``train.gar`` (``router.gar``, deprecated)."""

    lam: float = 1e-3  # the config's "lambda" (a Python keyword)
    eps: float = 1e-8  # added to each expert's routed mass, which GAR's objective divides by
    mode: str = "materialized"  # or "gram" (appendix G.2, no [M, d] observation matrix)
    unit: str = "group"  # observation unit: "group", "example" or "token"
    # instead of lambda: lambda set every step so that GAR's gradient on the router parameters is this
    # fraction of the task loss's (an extension, not the paper's: its lambdas gave GAR <= 1.5% here)
    share: float | None = None

    _KEYS = {"lambda": "lam", "eps": "eps", "mode": "mode", "unit": "unit", "share": "share"}

    def __post_init__(self):
        types = hints(GARConfig)
        for key, name in self._KEYS.items():
            value = getattr(self, name)
            if not fits(value, types[name]):
                raise ValueError(f"gar key {key!r} must be {wanted(types[name])}, got {shown(value)}")
        for key, value in (("lambda", self.lam), ("eps", self.eps)):
            if not value >= 0:
                raise ValueError(f"gar key {key!r} must be a finite number >= 0, got {shown(value)}")
        if self.share is not None and not self.share > 0:
            raise ValueError(f"gar key 'share' must be a finite number > 0 (GAR's gradient over the task's on the "
                             f"router), got {shown(self.share)}")
        for key, value, allowed in (("mode", self.mode, MODES), ("unit", self.unit, UNITS)):
            if value not in allowed:
                raise ValueError(f"gar key {key!r} must be one of {list(allowed)}, got {value!r}")

    @classmethod
    def from_dict(cls, d: dict, where: str = "config key 'train.gar'") -> GARConfig:
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be a mapping, got {d!r}")
        unknown = sorted(set(d) - set(cls._KEYS))
        if unknown:
            raise ValueError(f"unknown gar key {unknown[0]!r}; valid keys: {sorted(cls._KEYS)}")
        if d.get("share") is not None and d.get("lambda") is not None:
            raise ValueError(f"{where}: set one of 'lambda' (fixed) and 'share' (lambda set by the gradient share), "
                             f"got lambda={d['lambda']!r} and share={d['share']!r}")
        # lambda: null beside a share (an override over a config's fixed lambda) leaves the share in charge
        return cls(**{cls._KEYS[k]: v for k, v in d.items() if not (k == "lambda" and v is None)})

    @staticmethod
    def check_router(router_type: str, where: str = "config key 'train.gar'") -> None:
        """Refuse a router whose probabilities do not depend on its parameters."""
        if router_type not in DIFFERENTIABLE:
            raise ValueError(f"{where} needs a differentiable router {sorted(DIFFERENTIABLE)}, not {router_type!r}")

    @classmethod
    def for_router(cls, d: dict, router_type: str, where: str = "config key 'train.gar'") -> GARConfig:
        """``from_dict`` for ``router_type``'s GAR (``check_router``)."""
        cls.check_router(router_type, where)
        return cls.from_dict(d, where)

    def to_dict(self) -> dict:
        """The config's mapping: ``lambda`` or ``share``, whichever sets the coefficient."""
        drop = "lambda" if self.share is not None else "share"
        return {key: getattr(self, name) for key, name in self._KEYS.items() if key != drop}


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
