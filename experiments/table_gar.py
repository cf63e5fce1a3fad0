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
        mine = {r["seed"]: r for r in rs}
        common = sorted(set(mine) & set(base))
        cells = []
        for key, _ in METRICS:
            p = paired([mine[s][key] for s in common], [base[s][key] for s in common])
            scale, unit, d = (100, " pts", 2) if key == "val_macro_acc" else (1, "", 4)
            text = (f"{scale * p['mean']:+.{d}f}{unit} [{scale * p['lo']:+.{d}f}, {scale * p['hi']:+.{d}f}] "
                    f"(p={p['p']:.3f})")
            cells.append(f"**{text}**" if p["p"] < 0.05 else text)
        deltas.append(f"| {arm} | {len(common)} | " + " | ".join(cells) + " |")
    _plot(plot, out_dir / "gar.png")
    return "\n".join(lines + deltas + ["", "![GAR against its baselines](results/gar.png)"])


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
