"""GAR's settings: ``train.gar`` in a training config (``router.gar`` until the next release)."""
from __future__ import annotations

from dataclasses import dataclass

UNITS = ("group", "example", "token")  # observation units (section 5.2, appendix G.2)
MODES = ("materialized", "gram")  # the [M, d] observations, or their Gram matrix (appendix G.2)
# GAR needs router probabilities that depend differentiably on router parameters.
DIFFERENTIABLE = ("switch", "deepseek_v3", "skywork", "branch")


@dataclass
class GARConfig:
    lam: float = 1e-3
    eps: float = 1e-8
    mode: str = "materialized"  # or "gram" (appendix G.2, no [M, d] observation matrix)
    unit: str = "group"  # observation unit: "group", "example" or "token"

    _KEYS = {"lambda": "lam", "eps": "eps", "mode": "mode", "unit": "unit"}

    @classmethod
    def from_dict(cls, d: dict, where: str = "config key 'train.gar'") -> "GARConfig":
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be a mapping, got {d!r}")
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

    @classmethod
    def for_router(cls, d: dict, router_type: str, where: str = "config key 'train.gar'") -> "GARConfig":
        """``from_dict``, refusing a router whose probabilities do not depend on its parameters."""
        if router_type not in DIFFERENTIABLE:
            raise ValueError(f"{where} needs a differentiable router {sorted(DIFFERENTIABLE)}, not {router_type!r}")
        return cls.from_dict(d, where)
