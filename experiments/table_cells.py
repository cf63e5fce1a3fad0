"""What every experiment's table is made of: cells (mean ± sd, numbers, rows grouped by keys) and
the header that says what was run and how to run it again."""
from __future__ import annotations

import inspect
import math
from collections import Counter, defaultdict

import numpy as np

from experiments.plans import PLANS


def mean_sd(values) -> str:
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if not len(v):
        return "n/a"
    return f"{v.mean():.4f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.4f}"


def fmt(x, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def by(rows, *keys) -> dict:
    out = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def runs_header(name: str, rows, *cell_keys) -> str:
    """What was run, exactly: the command that reproduces these rows (with --seeds when they are not
    the plan's default), how many runs, and the seeds of every cell that differs from the rest."""
    cells = by(rows, *cell_keys)
    seeds = {key: tuple(sorted({r["seed"] for r in rs})) for key, rs in cells.items()}
    common = Counter(seeds.values()).most_common(1)[0][0]
    default = tuple(inspect.signature(PLANS[name]).parameters["seeds"].default)
    command = f".venv/bin/python -m experiments.run {name}"
    if common != default:
        command += " --seeds " + ",".join(map(str, common))
    text = (f"Command: `{command}`. {len(rows)} runs on {dates_of(rows)}: seeds {','.join(map(str, common))} in each "
            f"of the {len(cells)} {' x '.join(cell_keys)} cells")
    odd = [f"{'/'.join(map(str, key))} seeds {','.join(map(str, s))}" for key, s in sorted(seeds.items())
           if s != common]
    return text + (f" except {'; '.join(odd)}." if odd else ".")


def dates_of(rows) -> str:
    return ", ".join(sorted({r["date"] for r in rows}))
