"""Paired comparisons across seeds (the BRANCH and GAR papers' convention: paired Student t,
n - 1 degrees of freedom, nominal 95% intervals, no multiplicity adjustment)."""
from __future__ import annotations

import math

import numpy as np


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom (numerical integration)."""
    if not math.isfinite(t):
        return 0.0
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    x = np.linspace(0.0, abs(t), 20001)
    pdf = np.exp(log_norm - (df + 1) / 2 * np.log1p(x * x / df))
    inside = 2 * np.trapezoid(pdf, x)
    return float(min(1.0, max(0.0, 1.0 - inside)))


def t_quantile_975(df: int) -> float:
    """The 97.5% quantile of Student's t (bisection on the two-sided p)."""
    lo, hi = 0.0, 100.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > 0.05 else (lo, mid)
    return (lo + hi) / 2


def paired(a, b) -> dict:
    """Mean of a - b over paired seeds, its 95% interval, t and two-sided p."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    n = len(d)
    if n < 2:
        return {"n": n, "mean": float(d.mean()) if n else math.nan, "t": math.nan, "p": math.nan,
                "lo": math.nan, "hi": math.nan}
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    se = sd / math.sqrt(n)
    t = mean / se if se > 0 else (math.inf if mean else 0.0) * (1 if mean >= 0 else -1)
    half = t_quantile_975(n - 1) * se
    return {"n": n, "mean": mean, "t": t, "p": t_two_sided_p(t, n - 1), "lo": mean - half, "hi": mean + half}
