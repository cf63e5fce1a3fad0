"""Communication-cost reports for a training run: JSON, Markdown and PNG plots.

``write_report(run_dir, topology)`` reads the run's recorded routing
(``routing.npz``: the experts every validation token chose, and its rank) and its
``metrics.jsonl``, and writes to ``run_dir``:

report.json        everything below, as numbers
report.md          the tables, linking the plots
traffic_heatmap.png   rank x rank dispatch bytes (the run's placement, rank dedup)
bytes_by_level.png    bytes per token at each topology level, per placement and dedup mode
expert_load.png       tokens per expert
tree_distance.png     normalised tree distance of co-selected experts over training

Bytes are exact (``dispatch_traffic``) for the recorded tokens on ``topology``;
a run recorded on another number of ranks has its tokens dealt round-robin over
the topology's ranks. Times are the topology's alpha-beta estimate per
all-to-all. Placements compared: the run's, tree-prefix, and one optimized from
the recorded co-activation.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from placement.files import replacing, write_atomic
from placement.locality import node_share, random_pair_tree_distance, tree_distance
from placement.placement import Placement, cut_weight
from placement.simulate import RoutingRecord, recorded_layers
from placement.topology import Topology
from placement.traffic import DEDUP_MODES, dispatch_traffic


def _placements(record: RoutingRecord, topology: Topology, run_placement: str) -> dict:
    e, w = record.num_experts, topology.world_size
    out = {}
    if run_placement == "tree_prefix" or e & (e - 1) == 0:
        out["tree_prefix"] = Placement.tree_prefix(e, topology)
    if run_placement in ("contiguous", "round_robin"):
        out[run_placement] = getattr(Placement, run_placement)(e, w)
    out["optimized"] = Placement.optimized(record.coactivation(), topology)
    return out


def analyze(record: RoutingRecord, topology: Topology, run_placement: str = "contiguous") -> dict:
    w = topology.world_size
    if record.num_experts % w:
        raise ValueError(f"{record.num_experts} experts do not divide over {w} ranks ({topology.describe()}); "
                         "pick a topology whose rank count divides the expert count, or use `dist-moe simulate`")
    t = record.expert_idx.shape[0]
    src = record.src_rank if record.world_size == w else torch.arange(t) % w
    out = {"topology": topology.describe(), "tokens": t, "token_bytes": record.token_bytes,
           "num_experts": record.num_experts, "run_placement": run_placement, "placements": {}}
    lower = record.token_bytes * (1 - 1 / topology.num_nodes) if topology.num_nodes > 1 else 0.0
    out["node_lower_bound_bytes_per_token"] = lower
    heat = record.dispatch["dedup"] if record.dispatch is not None else "rank"  # the heatmap shows the run's mode
    out["heatmap_dedup"] = heat
    for name, placement in _placements(record, topology, run_placement).items():
        modes = {}
        for dedup in DEDUP_MODES:
            traffic = dispatch_traffic(record.expert_idx, src, placement, topology, record.token_bytes, dedup)
            levels = traffic.by_level()
            modes[dedup] = {"bytes_per_token_by_level": {k: v / t for k, v in levels.items()},
                            "estimated_seconds": topology.cost.estimate(traffic, dedup),
                            "matrix": traffic.matrix.tolist() if dedup == heat else None}
        nodes = placement.expert_nodes(topology)
        out["placements"][name] = {"expert_to_rank": placement.expert_to_rank, "modes": modes,
                                   "node_cut_coactivation": cut_weight(record.coactivation(), nodes.tolist()),
                                   **_node_share(record, nodes, topology.num_nodes)}
    run = record.dispatch
    if run is not None and run["topology"] == topology.describe():  # the run's own dispatch, as it measured it
        placement = Placement(run["expert_to_rank"], w)
        traffic = dispatch_traffic(record.expert_idx, src, placement, topology, record.token_bytes, run["dedup"])
        out["run_dispatch"] = {"dedup": run["dedup"], "analytic_bytes_by_level": traffic.by_level(),
                               "measured_bytes_by_level": run["measured_bytes_by_level"]}
    valid = record.expert_idx[record.expert_idx >= 0]
    out["expert_load"] = torch.bincount(valid, minlength=record.num_experts).tolist()
    e = record.num_experts
    if e >= 2 and not e & (e - 1) and record.expert_idx.shape[1] >= 2:
        out["tree_distance"] = tree_distance(record.expert_idx, e)
        out["random_pair_tree_distance"] = random_pair_tree_distance(e)
    return out


def _node_share(record: RoutingRecord, expert_node: torch.Tensor, num_nodes: int) -> dict:
    idx = record.expert_idx
    share, cv = node_share(torch.bincount(idx[idx >= 0], minlength=record.num_experts), expert_node, num_nodes)
    return {"node_share": share, "node_share_cv": cv}


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_report(run_dir: str | Path, topology: Topology, run_placement: str = "contiguous") -> dict:
    """Write report.json, report.md and the PNGs into ``run_dir``; returns the report (the first MoE
    layer's analysis at the top, every layer's under "layers")."""
    run_dir = Path(run_dir)
    layers = [analyze(RoutingRecord.load(run_dir, i), topology, run_placement)
              for i in range(max(1, recorded_layers(run_dir)))]
    report = dict(layers[0])
    report["layers"] = [{k: v for k, v in a.items() if k in ("placements", "run_dispatch", "expert_load",
                                                              "tree_distance")} for a in layers]
    report["heatmap_dedup"] = layers[0]["heatmap_dedup"]
    steps = [r for r in _metrics(run_dir) if "loss" in r]
    report["training"] = {
        "steps": [r["step"] for r in steps],
        "tree_distance": [r.get("tree_distance") for r in steps],
        "measured_bytes_by_level": {k[len("bytes_"):]: sum(r.get(k, 0) for r in steps)
                                    for k in sorted({k for r in steps for k in r if k.startswith("bytes_")})},
    }
    _plots(run_dir, report, topology)
    write_atomic(run_dir / "report.json", json.dumps(report, indent=1) + "\n")
    write_atomic(run_dir / "report.md", _markdown(report, topology))
    return report


def _markdown(report: dict, topology: Topology) -> str:
    levels = list(topology.levels)
    lines = [f"# Communication report: {report['tokens']} tokens on {report['topology']}", "",
             f"{report['num_experts']} experts, {report['token_bytes']} B per token copy; the run used "
             f"`{report['run_placement']}` placement. Bytes per token in the dispatch direction (the combine "
             "returns the same); estimated all-to-all time from the topology's alpha-beta model.", "",
             "| layer | placement | dedup | " + " | ".join(f"{lv} B/token" for lv in levels) + " | est. all-to-all |",
             "|---|---|---|" + "---|" * len(levels) + "---|"]
    for li, layer in enumerate(report["layers"]):
        for name, p in layer["placements"].items():
            for dedup, m in p["modes"].items():
                cells = " | ".join(f"{m['bytes_per_token_by_level'][lv]:.1f}" for lv in levels)
                lines.append(f"| {li} | {name} | {dedup} | {cells} | {1e6 * m['estimated_seconds']:.1f} us |")
    lines += ["", f"Lower bound across nodes: {report['node_lower_bound_bytes_per_token']:.1f} B/token "
              "(one copy to one other node)."]
    if topology.num_nodes > 1:
        lines.append("Per-node share of the routed slots (layer 0): " + "; ".join(
            f"{name} " + " / ".join(f"{v:.3f}" for v in p["node_share"]) + f" (CV {p['node_share_cv']:.3f})"
            for name, p in report["placements"].items()) + ".")
    if "tree_distance" in report:
        lines.append(f"Tree distance of co-selected experts: {report['tree_distance']:.3f} "
                     f"(random pairs {report['random_pair_tree_distance']:.3f}).")
    run = report.get("run_dispatch")
    if run:
        lines.append(f"The run's own dispatch (dedup={run['dedup']}) of these tokens: measured "
                     + ", ".join(f"{k} {v:,} B" for k, v in run["measured_bytes_by_level"].items())
                     + "; analytic " + ", ".join(f"{k} {v:,} B" for k, v in run["analytic_bytes_by_level"].items())
                     + ".")
    measured = report["training"]["measured_bytes_by_level"]
    if measured:
        lines.append("Measured during training (all ranks, all logged steps): "
                     + ", ".join(f"{k} {v:,} B" for k, v in measured.items()) + ".")
    lines += ["", "![rank x rank bytes](traffic_heatmap.png)", "![bytes per level](bytes_by_level.png)",
              "![expert load](expert_load.png)", "![tree distance](tree_distance.png)", ""]
    return "\n".join(lines)


def legend_below(fig, axes, space: float = 0.14) -> None:
    """One legend for the figure, under the plots, where it cannot cover a bar; then the layout."""
    handles, labels = {}, []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    fig.legend([handles[x] for x in labels], labels, loc="lower center", ncol=min(len(labels), 5), frameon=False)
    fig.tight_layout(rect=(0, space, 1, 1))


def _save(fig, path: Path) -> None:
    with replacing(path) as f:  # a PNG planted as a symlink is replaced, never written through
        fig.savefig(f, format="png", dpi=100)


def _plots(run_dir: Path, report: dict, topology: Topology) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_name = report["run_placement"] if report["run_placement"] in report["placements"] else "optimized"
    dedup = report["heatmap_dedup"]  # the run's own dedup mode
    matrix = torch.tensor(report["placements"][run_name]["modes"][dedup]["matrix"], dtype=torch.float64)
    fig, ax = plt.subplots(figsize=(5, 4))
    im = ax.imshow((matrix / 1024).numpy(), cmap="viridis")
    ax.set(title=f"dispatch KiB, {run_name} placement, {dedup} dedup", xlabel="destination rank",
           ylabel="source rank")
    ticks = range(0, matrix.shape[0], max(1, matrix.shape[0] // 16))  # whole ranks, at most 16 labels
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    _save(fig, run_dir / "traffic_heatmap.png")
    plt.close(fig)

    groups = [(li, name) for li, layer in enumerate(report["layers"]) for name in layer["placements"]]
    fig, axes = plt.subplots(1, len(topology.levels), figsize=(5 * len(topology.levels), 4), squeeze=False)
    width = 0.8 / len(DEDUP_MODES)
    for ax, level in zip(axes[0], topology.levels):
        for i, dedup in enumerate(DEDUP_MODES):
            values = [report["layers"][li]["placements"][n]["modes"][dedup]["bytes_per_token_by_level"][level]
                      for li, n in groups]
            ax.bar([j + i * width for j in range(len(groups))], values, width, label=f"dedup={dedup}")
        if level == topology.levels[0]:
            ax.axhline(report["node_lower_bound_bytes_per_token"], color="k", ls="--", lw=1, label="lower bound")
        ax.set_xticks([j + width for j in range(len(groups))], [f"L{li} {n}" for li, n in groups], rotation=20)
        ax.set(title=f"bytes per token crossing the {level} level", ylabel="B/token")
    legend_below(fig, axes[0])
    _save(fig, run_dir / "bytes_by_level.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.bar(range(report["num_experts"]), report["expert_load"])
    ax.set(title="tokens per expert (validation)", xlabel="expert", ylabel="tokens")
    fig.tight_layout()
    _save(fig, run_dir / "expert_load.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3))
    tr = report["training"]
    pts = [(s, d) for s, d in zip(tr["steps"], tr["tree_distance"]) if d is not None]
    if pts:
        ax.plot(*zip(*pts), label="co-selected experts")
    if "random_pair_tree_distance" in report:
        ax.axhline(report["random_pair_tree_distance"], color="k", ls="--", lw=1, label="random pairs")
    ax.set(title="normalised tree distance over training", xlabel="step", ylabel="tree distance")
    ax.legend()
    fig.tight_layout()
    _save(fig, run_dir / "tree_distance.png")
    plt.close(fig)
