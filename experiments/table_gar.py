"""Experiment 3 tables: GAR against task-loss-only routing and the Switch aux loss."""
from __future__ import annotations

import numpy as np

from experiments.plans import GAR_ARMS
from experiments.stats import paired
from experiments.table_cells import by, mean_sd, runs_header

METRICS = (("val_macro_acc", "macro acc"), ("lvar", "LVar"), ("utilization", "Util"),
           ("gradient_purity", "grad purity"), ("nmi", "NMI"))


def make(rows, out_dir) -> str:
    groups = by(rows, "arm")
    base = {r["seed"]: r for r in groups.get(("task_only",), [])}
    lines = [f"{runs_header('gar', rows, 'arm')} One process: same-task groups span the whole batch. "
             "Five tasks from installed text (WordNet part of speech, "
             "noun and verb lexicographer files, fortunes-min source, corpus domain), 400 examples each, 20% "
             "held out by the seed; frozen all-MiniLM-L6-v2 token states (32 tokens), E=8 LoRA experts (rank 8) "
             "top-4, switch router (jitter 0.01), groups of 8 same-task examples, 5 epochs (170 steps), Adam lr "
             "2e-3, last epoch evaluated. λ: GAR's fixed coefficient; share s (`train.gar.share`, an extension): "
             "λ set every step so that GAR's router gradient is s times the task loss's. "
             "Metrics as the GAR paper's appendix E: equal-task macro accuracy; LVar and Util from per-example "
             "post-top-k router mass; gradient-mass purity from per-task expert-gradient observations (8 "
             "validation micro-batches of 8 per task); NMI from token selections. Mean ± sample sd.", "",
             "| arm | λ or share | aux | " + " | ".join(n for _, n in METRICS) + " |",
             "|---|---|---|" + "---|" * len(METRICS)]
    deltas = ["", "Paired differences from task-only routing over the seeds both arms ran (mean [95% interval] "
              "(p), paired t; **bold**: resolved at p < 0.05):", "",
              "| arm | seeds | " + " | ".join(f"Δ {n}" for _, n in METRICS) + " |",
              "|---|---|" + "---|" * len(METRICS)]
    plot = {}
    for arm in GAR_ARMS:
        rs = groups.get((arm,))
        if not rs:
            continue
        coefficient = f"share {rs[0]['share']:g}" if rs[0].get("share") is not None else f"{rs[0]['lambda']:g}"
        lines.append(f"| {arm} | {coefficient} | {rs[0]['aux']:g} | "
                     + " | ".join(mean_sd(r[key] for r in rs) for key, _ in METRICS) + " |")
        plot[arm] = {key: [r[key] for r in rs] for key, _ in METRICS}
        if arm == "task_only" or not base:
            continue
        deltas.append(f"| {arm} | " + " | ".join(_paired_cells(rs, base.values())) + " |")
    _plot(plot, out_dir / "gar.png")
    return "\n".join(lines + deltas + ["", "![GAR against its baselines](results/gar.png)"])


def _paired_cells(rows, base_rows) -> list[str]:
    """The seeds both sets ran, then mean [95% interval] (p) of rows - base_rows for every metric
    (**bold**: p < 0.05)."""
    mine, base = {r["seed"]: r for r in rows}, {r["seed"]: r for r in base_rows}
    common = sorted(set(mine) & set(base))
    cells = [str(len(common))]
    for key, _ in METRICS:
        p = paired([mine[s][key] for s in common], [base[s][key] for s in common])
        scale, unit, d = (100, " pts", 2) if key == "val_macro_acc" else (1, "", 4)
        text = f"{scale * p['mean']:+.{d}f}{unit} [{scale * p['lo']:+.{d}f}, {scale * p['hi']:+.{d}f}] (p={p['p']:.3f})"
        cells.append(f"**{text}**" if p["p"] < 0.05 else text)
    return cells


def make_ep(rows, out_dir, one_process) -> str:
    """The expert-parallel runs (``gar_ep``) against the one-process runs (``gar``) of the same arm
    and seed, and GAR's effect within them."""
    groups, alone = by(rows, "ranks", "arm"), by(one_process, "arm")
    metric_names = " | ".join(n for _, n in METRICS)
    lines = [f"{runs_header('gar_ep', rows, 'ranks', 'arm')} The `gar` setting with the experts over 2 or 4 "
             "gloo ranks (2 cores; 4 ranks as 2 nodes x 2): the same global batch of 48 rows (24 or 12 per "
             "rank), same-task groups of 8 formed over every rank's rows (a rank's part of a group may be "
             "empty), GAR's observations and router summaries reduced over the ranks; the diagnostics reduced "
             "over the ranks too (GAR's step cost: `benchmarks/gar_overhead.py`).", "",
             f"| ranks | arm | {metric_names} |", "|---|---|" + "---|" * len(METRICS)]
    against = ["", "Expert parallel minus one process, paired by seed (mean [95% interval] (p); **bold**: the two "
               "differ at p < 0.05):", "", f"| ranks | arm | seeds | {' | '.join(f'Δ {n}' for _, n in METRICS)} |",
               "|---|---|---|" + "---|" * len(METRICS)]
    effect = ["", "GAR's effect under expert parallelism: paired differences from task-only routing at the same "
              "ranks (**bold**: resolved at p < 0.05):", "",
              f"| ranks | arm | seeds | {' | '.join(f'Δ {n}' for _, n in METRICS)} |",
              "|---|---|---|" + "---|" * len(METRICS)]

    for ranks in sorted({k[0] for k in groups}):
        base = groups.get((ranks, "task_only"), [])
        for arm in GAR_ARMS:
            rs = groups.get((ranks, arm))
            if not rs:
                continue
            lines.append(f"| {ranks} | {arm} | " + " | ".join(mean_sd(r[key] for r in rs) for key, _ in METRICS)
                         + " |")
            if alone.get((arm,)):
                against.append(f"| {ranks} | {arm} | " + " | ".join(_paired_cells(rs, alone[(arm,)])) + " |")
            if arm != "task_only" and base:
                effect.append(f"| {ranks} | {arm} | " + " | ".join(_paired_cells(rs, base)) + " |")
    return "\n".join(lines + against + effect)


def _plot(plot, path) -> None:
    # matplotlib: optional and slow to import, only when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(3.2 * len(METRICS), 3.4))
    arms = list(plot)
    for ax, (key, name) in zip(axes, METRICS):
        for i, arm in enumerate(arms):
            v = plot[arm][key]
            ax.bar(i, np.mean(v), color="tab:blue" if "share" in arm else "tab:orange" if arm.startswith("gar")
                   else "tab:gray")
            ax.plot([i] * len(v), v, "k.", ms=4)
        ax.set_xticks(range(len(arms)), arms, rotation=40, ha="right", fontsize=8)
        ax.set_title(name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
