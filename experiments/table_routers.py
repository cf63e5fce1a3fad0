"""Experiment 1 tables: BRANCH-MoE against the flat routers (loss, balance, locality, bytes)."""
from __future__ import annotations

import numpy as np

from experiments.plans import DATASETS, ROUTER_ARMS
from experiments.stats import paired
from experiments.table_cells import by, fmt, mean_sd, runs_header
from placement.report import legend_below

FLAT = ("switch", "deepseek_v3", "skywork", "hash")  # the unlimited flat routers
LIMITED = ("branch_linear_limit1", "branch_mlp4_limit1", "branch_linear_limit1_bal", "branch_mlp4_limit1_bal")
NODE_LIMITED_FLAT = "deepseek_v3_node1"
LM = {"lm_domains": "tiny MoE LM, validation nats/byte"}


def own_placement(arm: str) -> str:
    """BRANCH's tree-prefix; a node-limited flat router's contiguous (its node groups); else optimized."""
    if arm.startswith("branch"):
        return "tree_prefix"
    return "contiguous" if arm == NODE_LIMITED_FLAT else "optimized"


def _mean(rows, key):
    return float(np.mean([r[key] for r in rows]))


def make(rows, out_dir) -> str:
    lines = [f"{runs_header('routers', rows, 'dataset', 'arm')} 4 ranks via torchrun, accounted as node=2,gpu=2. "
             "E=16, top-4, capacity factor 1.25, SwiGLU experts "
             "(ffn 32), Adam lr 3e-3, 64 rows per rank (256 per step), "
             f"{rows[0]['steps']} steps; 20% validation split drawn by the seed; the last step is evaluated "
             "(no selection). Loss is held-out cross-entropy.", _COLUMNS, ""]
    return "\n".join(lines) + "\n" + _tables(rows, out_dir, DATASETS, "routers.png", "E=16 top-4")


def make_lm(rows, out_dir) -> str:
    lines = [f"{runs_header('lm_routers', rows, 'dataset', 'arm')} 4 ranks via torchrun, accounted as "
             "node=2,gpu=2, node dedup: `configs/lm_branch.yaml` (2 MoE layers, E=8 top-2, no capacity limit), "
             f"500 sequences per domain, {rows[0]['steps']} steps; loss is validation nats per byte. Bytes are "
             "the first MoE layer's.", _COLUMNS, ""]
    return "\n".join(lines) + "\n" + _tables(rows, out_dir, LM, "lm_routers.png", "tiny LM, E=8 top-2")


_COLUMNS = ("Copies = node-crossing bytes per token / token bytes on the run's validation routing (2 nodes: "
            "lower bound 0.5). BRANCH uses tree-prefix placement, DeepSeek-V3 node-limited the contiguous "
            "placement its node groups come from, the other flat routers `Placement.optimized` from their "
            "co-activation; the contiguous column is the same router's contiguous placement (for BRANCH on "
            "2 x 2 it equals tree-prefix). Node CV: the CV of the two nodes' shares of the routed slots. "
            "`_limit1`: `router.subtree_limit=1 router.subtree_balance=none`; `_bal`: the limit with "
            "`subtree_balance=bias` and DeepSeek-V3's `sign` rule (`router.balance_rule=sign "
            "router.balance_eval=false`; the defaults are `newton` and `true`); `_node1`: `router.node_limit=1`.")


def _tables(rows, out_dir, datasets: dict, png: str, what: str) -> str:
    groups = by(rows, "dataset", "arm")
    lines = []
    summary = []
    for data, label in datasets.items():
        arms = [a for a in ROUTER_ARMS if (data, a) in groups]
        if not arms:
            continue
        seeds_by_arm = {a: {r["seed"]: r for r in groups[(data, a)]} for a in arms}
        flat = [a for a in FLAT if a in arms]
        best_flat = min(flat, key=lambda a: _mean(groups[(data, a)], "val_loss")) if flat else None
        lines += [f"#### {data} ({label})", "",
                  "| router | loss (mean ± sd) | acc | load CV | node CV | tree dist | vs random | copies none / rank "
                  "/ node (own placement) | contiguous none / node | paired Δloss vs best flat (t, p) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for a in arms:
            rs = groups[(data, a)]
            place = own_placement(a)
            copies = " / ".join(fmt(_mean(rs, f"copies_{place}_{d}"), 2) for d in ("none", "rank", "node"))
            contig = (f"{_mean(rs, 'copies_contiguous_none'):.2f} / {_mean(rs, 'copies_contiguous_node'):.2f}"
                      if "copies_contiguous_none" in rs[0] else "= own")
            td = _mean(rs, "val_tree_distance")
            rand = rs[0]["random_pair_tree_distance"]
            test = "—"
            if best_flat and a != best_flat:
                p = _paired(seeds_by_arm, a, best_flat)
                test = f"{p['mean']:+.4f} (t{p['n'] - 1}={p['t']:.2f}, p={p['p']:.3f})"
            # older rows did not record node shares: a mean of every seed or none
            node_cv = _mean(rs, "val_node_share_cv") if all("val_node_share_cv" in r for r in rs) else None
            lines.append(f"| {a}{' (best flat)' if a == best_flat else ''} | {mean_sd(r['val_loss'] for r in rs)} | "
                         f"{_mean(rs, 'val_acc'):.4f} | {_mean(rs, 'val_load_cv'):.3f} | {fmt(node_cv)} | {td:.3f} | "
                         f"{100 * (td / rand - 1):+.1f}% | {copies} | {contig} | {test} |")
            busy = _mean(rs, "val_busiest_rank") if all("val_busiest_rank" in r for r in rs) else None
            summary.append((data, a, td, rand, _mean(rs, f"copies_{place}_node"),
                            _mean(rs, "copies_contiguous_none") if "copies_contiguous_none" in rs[0] else None,
                            rs[0]["lower_bound_copies"], node_cv, busy, _mean(rs, "val_dropped_fraction")))
        lines.append("")
        lines += _limited_goals(data, summary, seeds_by_arm, best_flat), ""
    if datasets is DATASETS:
        lines += _targets(summary, groups), ""
    _plot(summary, out_dir / png, [a for a in ROUTER_ARMS if any(s[1] == a for s in summary)], what)
    lines.append(f"![tree distance and node-crossing copies per router](results/{png})")
    return "\n".join(lines)


def _paired(seeds_by_arm, a, b) -> dict:
    common = sorted(set(seeds_by_arm[a]) & set(seeds_by_arm[b]))
    return paired([seeds_by_arm[a][s]["val_loss"] for s in common], [seeds_by_arm[b][s]["val_loss"] for s in common])


def _limited_goals(data, summary, seeds_by_arm, best_flat) -> str:
    """The subtree-limited arms against the goals, each beside its measured value."""
    rows = {s[1]: s for s in summary if s[0] == data}
    flats = [rows[a][5] for a in FLAT if a in rows and rows[a][5] is not None]
    out = ["| told the node boundary | copies (node dedup) / lower bound (goal <= 1.1x) | / flat contiguous no-dedup "
           "(goal <= 0.30x) | node share CV (goal <= 0.05) | busiest rank / mean (goal <= 1.15x) | dropped "
           "(goal <= unlimited BRANCH's) | Δloss vs best flat (goal p > 0.05 or better) | "
           f"Δloss vs {NODE_LIMITED_FLAT} (goal not worse) |", "|---|---|---|---|---|---|---|---|"]
    if not flats or not any(a in rows for a in (*LIMITED, NODE_LIMITED_FLAT)):
        return ""
    for a in (*LIMITED, NODE_LIMITED_FLAT):
        if a not in rows:
            continue
        node, lower, cv, busy, drop = rows[a][4], rows[a][6], rows[a][7], rows[a][8], rows[a][9]
        free = rows.get("branch_mlp4" if "mlp4" in a else "branch_linear")  # the same map, unlimited
        drops = f"{100 * drop:.1f}%" + (f" (unlimited {100 * free[9]:.1f}%)" if free and a in LIMITED else "")
        cells = []
        for ref in (best_flat, NODE_LIMITED_FLAT):
            if ref is None or ref == a or ref not in seeds_by_arm:
                cells.append("—")
                continue
            p = _paired(seeds_by_arm, a, ref)
            cells.append(f"{p['mean']:+.4f} (p={p['p']:.3f}, 95% CI {p['lo']:+.4f}..{p['hi']:+.4f})")
        out.append(f"| {a} | {node / lower:.2f}x | {node / float(np.mean(flats)):.2f}x | {fmt(cv)} | "
                   f"{'—' if busy is None else f'{busy:.2f}x'} | {drops} | {cells[0]} | {cells[1]} |")
    return "\n".join(out)


def _targets(summary, groups) -> str:
    """BRANCH (linear) against the issue's targets, per dataset."""
    out = ["| dataset | BRANCH linear tree dist / random | copies (tree-prefix, node dedup) / lower bound | "
           "/ flat contiguous no-dedup (mean of flat routers) |", "|---|---|---|---|"]
    for data in DATASETS:
        mine = [s for s in summary if s[0] == data and s[1] == "branch_linear"]
        flats = [s[5] for s in summary if s[0] == data and s[1] in FLAT and s[5] is not None]
        if not mine or not flats:
            continue
        _, _, td, rand, node, _, lower = mine[0][:7]
        out.append(f"| {data} | {td / rand:.3f} (target <= 0.90) | {node / lower:.2f}x (target <= 1.2x) | "
                   f"{node / float(np.mean(flats)):.2f}x (target <= 0.35x) |")
    return "\n".join(out)


def _plot(summary, path, arms, what: str) -> None:
    # matplotlib: optional and slow to import, only when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(s[0] for s in summary))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(1, len(datasets))
    for i, data in enumerate(datasets):
        rows = {s[1]: s for s in summary if s[0] == data}
        x = np.arange(len(arms)) + i * width
        axes[0].bar(x, [rows[a][2] if a in rows else 0 for a in arms], width, label=data)
        axes[1].bar(x, [rows[a][4] if a in rows else 0 for a in arms], width, label=data)
    rand = summary[0][3]
    axes[0].axhline(rand, color="k", ls="--", lw=1, label=f"random pairs {rand:.3f}")
    axes[0].set_ylim(0.3, 0.9)
    axes[0].set_ylabel("normalised tree distance of co-selected experts")
    axes[1].axhline(summary[0][6], color="k", ls="--", lw=1, label="lower bound")
    axes[1].set_ylabel("copies across nodes per token\n(node dedup, own placement)")
    for ax in axes:
        ax.set_xticks(np.arange(len(arms)) + 0.4 - width / 2, arms, rotation=30, ha="right")
    fig.suptitle(f"BRANCH-MoE vs flat routers, {what}, 4 ranks as 2 nodes x 2")
    legend_below(fig, axes, 0.1)
    fig.savefig(path, dpi=110)
    plt.close(fig)
