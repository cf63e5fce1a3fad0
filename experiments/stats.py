"""Paired comparisons across seeds (the BRANCH and GAR papers' convention: paired Student t,
n - 1 degrees of freedom, nominal 95% intervals, no multiplicity adjustment), with scipy.stats."""
from __future__ import annotations

import math

import numpy as np
from scipy import stats


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    return 0.0 if not math.isfinite(t) else float(2 * stats.t.sf(abs(t), df))


def t_quantile_975(df: int) -> float:
    """The 97.5% quantile of Student's t."""
    return float(stats.t.ppf(0.975, df))


def paired(a, b) -> dict:
    """Mean of a - b over paired seeds, its 95% interval, t and two-sided p (``ttest_rel``)."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    n = len(d)
    if n < 2:
        return {"n": n, "mean": float(d.mean()) if n else math.nan, "t": math.nan, "p": math.nan,
                "lo": math.nan, "hi": math.nan}
    mean, se = float(d.mean()), float(d.std(ddof=1)) / math.sqrt(n)
    if se > 0:
        test = stats.ttest_rel(np.asarray(a, dtype=float), np.asarray(b, dtype=float))
        t, p = float(test.statistic), float(test.pvalue)
    else:  # identical differences: no spread to test against (scipy returns nan here)
        t = (math.inf if mean else 0.0) * (1 if mean >= 0 else -1)
        p = t_two_sided_p(t, n - 1)
    half = t_quantile_975(n - 1) * se
    return {"n": n, "mean": mean, "t": t, "p": p, "lo": mean - half, "hi": mean + half}
