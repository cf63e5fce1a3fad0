"""Results rows -> markdown tables, a plot, and docs/RESULTS.md's block for the experiment.

Each experiment's block in RESULTS.md sits between ``<!-- results:NAME -->`` and
``<!-- /results:NAME -->`` and is replaced whole; the prose around it is written by hand.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np


def load_rows(results: Path) -> list[dict]:
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()] if results.exists() else []


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
    import inspect
    from collections import Counter

    from experiments.plans import PLANS

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


def replace_block(doc: Path, name: str, body: str) -> None:
    start, end = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
    text = doc.read_text() if doc.exists() else "# Results\n"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


def write(name: str, results: Path, docs: Path) -> str:
    from experiments import table_gar, table_routers, table_specdrop, table_throughput, table_throughput_link

    makers = {"routers": table_routers.make, "specdrop": table_specdrop.make, "gar": table_gar.make,
              "throughput": table_throughput.make, "throughput_link": table_throughput_link.make,
              "lm_routers": table_routers.make_lm}
    rows = load_rows(results)
    if not rows:
        raise SystemExit(f"no results in {results}: run the experiment first")
    out_dir = docs / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    body = makers[name](rows, out_dir)
    (out_dir / f"{name}.md").write_text(body + "\n")
    replace_block(docs / "RESULTS.md", name, body)
    print(body)
    return body
