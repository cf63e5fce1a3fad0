"""Experiment 2 tables: SpecDrop against its controls on aligned partitions and on the LM."""
from __future__ import annotations

import numpy as np

from experiments.plans import SPECDROP_ARMS
from experiments.stats import paired
from experiments.table_cells import by, mean_sd, runs_header

LABELS = {"fashion_mnist": "Fashion-MNIST, 4 garment superclasses (this project's grouping; 20,000 images, 3 epochs)",
          "wordnet_glosses": "WordNet glosses -> 45 lexicographer files inside 4 parts of speech "
                             "(MiniLM gloss embeddings, 8,434 synsets, 8 epochs)",
          "lm_domains": "tiny byte-level MoE LM, 4 corpus domains as categories (fuzzy: next-byte targets share "
                        "one output space), 150 steps"}


def _m(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(np.mean(vals)) if vals else float("nan")


def make(rows, out_dir) -> str:
    groups = by(rows, "dataset", "arm")
    lines = [f"{runs_header('specdrop', rows, 'dataset', 'arm')} 4 ranks via torchrun, node=2,gpu=2. "
             "20% validation split drawn by the seed, last step evaluated. Arms: soft SpecDrop "
             "(p_a 0.7), No-Routing (uniform 1/K merge), HardCategory (own expert only), dense + label-aware "
             "logit masking (uniform merge, logits outside the category masked in training and evaluation). "
             "Masked acc: the same model's logits masked to the row's category at evaluation; masking gain = "
             "masked - unmasked; left = share of predictions outside the given category.", ""]
    plot = {}
    for data, label in LABELS.items():
        arms = [a for a in SPECDROP_ARMS if (data, a) in groups]
        if not arms:
            continue
        lm = data == "lm_domains"
        base = {r["seed"]: r for r in groups.get((data, "no_routing"), [])}
        lines += [f"#### {label}", ""]
        if lm:
            lines += ["| arm | val loss (nats/byte) | byte acc | Align | paired Δloss vs No-Routing (t, p) |",
                      "|---|---|---|---|---|"]
        else:
            lines += ["| arm | val acc (mean ± sd) | Align | masked acc | masking gain | left category | "
                      "paired Δacc vs No-Routing (t, p) |", "|---|---|---|---|---|---|---|"]
        for a in arms:
            rs = groups[(data, a)]
            test = "—"
            if a != "no_routing" and base:
                mine = {r["seed"]: r for r in rs}
                common = sorted(set(mine) & set(base))
                key = "val_loss" if lm else "val_acc"
                p = paired([mine[s][key] for s in common], [base[s][key] for s in common])
                test = f"{p['mean']:+.4f} (t{p['n'] - 1}={p['t']:.2f}, p={p['p']:.3f})"
            align = f"{_m(rs, 'val_align'):.2f}" if any(r.get("val_align") is not None for r in rs) else "—"
            if lm:
                lines.append(f"| {a} | {mean_sd(r['val_loss'] for r in rs)} | {_m(rs, 'val_acc'):.4f} | {align} | "
                             f"{test} |")
            else:
                lines.append(f"| {a} | {mean_sd(r['val_acc'] for r in rs)} | {align} | "
                             f"{_m(rs, 'val_acc_masked'):.4f} | {100 * _m(rs, 'masking_gain'):+.2f} pts | "
                             f"{100 * _m(rs, 'left_category'):.2f}% | {test} |")
            plot.setdefault(data, {})[a] = [r["val_loss" if lm else "val_acc"] for r in rs]
        lines.append("")
    _plot(plot, out_dir / "specdrop.png")
    lines.append("![SpecDrop and its controls](results/specdrop.png)")
    return "\n".join(lines)


def _plot(plot, path) -> None:
    # matplotlib: optional and slow to import, only when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(plot), figsize=(4.5 * len(plot), 3.8), squeeze=False)
    for ax, (data, arms) in zip(axes[0], plot.items()):
        names = list(arms)
        means = [np.mean(v) for v in arms.values()]
        sds = [np.std(v, ddof=1) if len(v) > 1 else 0 for v in arms.values()]
        ax.bar(range(len(names)), means, yerr=sds, capsize=4, color="tab:blue")
        for i, v in enumerate(arms.values()):
            ax.plot([i] * len(v), v, "k.", ms=4)
        lo = min(min(v) for v in arms.values())
        hi = max(max(v) for v in arms.values())
        ax.set_ylim(lo - 0.3 * (hi - lo + 1e-3), hi + 0.3 * (hi - lo + 1e-3))
        ax.set_xticks(range(len(names)), names, rotation=25, ha="right")
        ax.set_title(data)
        ax.set_ylabel("val loss (nats/byte)" if data == "lm_domains" else "val accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
