"""Results rows -> markdown tables, a plot, and docs/RESULTS.md's block for the experiment.

Each experiment's block in RESULTS.md sits between ``<!-- results:NAME -->`` and
``<!-- /results:NAME -->`` and is replaced whole; the prose around it is written by hand.
"""
from __future__ import annotations

import json
from pathlib import Path

from experiments import (
    table_ep_layouts,
    table_gar,
    table_routers,
    table_specdrop,
    table_throughput,
    table_throughput_link,
)


def load_rows(results: Path) -> list[dict]:
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()] if results.exists() else []


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
    makers = {"routers": table_routers.make, "specdrop": table_specdrop.make, "gar": table_gar.make,
              # the expert-parallel GAR runs are read against the one-process runs beside them
              "gar_ep": lambda rows, out: table_gar.make_ep(rows, out, load_rows(results.parent / "gar.jsonl")),
              "throughput": table_throughput.make, "throughput_link": table_throughput_link.make,
              "lm_routers": table_routers.make_lm, "ep_layouts": table_ep_layouts.make}
    rows = load_rows(results)
    if not rows:
        raise SystemExit(f"no results in {results}: run the experiment first")
    out_dir = docs / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    body = makers[name](rows, out_dir)
    # the body's plot links are relative to docs/ (RESULTS.md); beside the plot, the file names it alone
    (out_dir / f"{name}.md").write_text(body.replace("](results/", "](") + "\n")
    replace_block(docs / "RESULTS.md", name, body)
    print(body)
    return body
