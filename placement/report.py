"""Communication-cost reports for a training run: JSON, Markdown and PNG plots.

``write_report(run_dir, topology)`` reads the run's recorded routing
(``routing.npz``: the experts every validation token chose, and its rank) and its
``metrics.jsonl`` (a torn last row, which a killed run leaves, skipped), checks first
that it can write its files, and writes to ``run_dir``:

report.json        everything below, as numbers
report.md          the tables, linking the plots
traffic_heatmap.png   rank x rank dispatch bytes (the run's placement, rank dedup)
bytes_by_level.png    bytes per token at each topology level, per placement and dedup mode
expert_load.png       tokens per expert, every MoE layer
tree_distance.png     normalised tree distance of co-selected experts over training

Bytes are exact (``dispatch_traffic``) for the recorded tokens on ``topology``;
a run recorded on another number of ranks has its tokens dealt round-robin over
the topology's ranks. Times are the alpha-beta estimate of one dispatch all-to-all
on the topology's link rates, which are the cost model's defaults unless the
topology came with measured ones (``dist-moe calibrate``): the report says which.
Placements compared: the run's own first (a placement file's as the run's
dispatch recorded it), tree-prefix, and one optimized from the recorded
co-activation. Node shares here are of the slots dispatched after capacity drops;
the training summary's are of the router's load before them.
"""
from __future__ import annotations

import json
import math
import reprlib
from pathlib import Path

import torch

from placement.cost import CostModel
from placement.files import check_output_file, read_jsonl, replacing, write_atomic
from placement.locality import node_share, random_pair_tree_distance, tree_distance
from placement.placement import NAMED, Placement, cut_weight
from placement.simulate import RoutingRecord, recorded_layers
from placement.topology import Topology
from placement.traffic import DEDUP_MODES, dispatch_traffic

OUTPUTS = ("report.json", "report.md", "traffic_heatmap.png", "bytes_by_level.png", "expert_load.png",
           "tree_distance.png")


def placement_name(run_placement: str) -> str:
    """The report's name for the run's placement: its name, or its file's name."""
    return Path(run_placement).name if run_placement.endswith((".yaml", ".yml")) else run_placement


def _placements(record: RoutingRecord, topology: Topology, run_placement: str) -> dict:
    """The run's own placement first, then tree-prefix (a power-of-two expert count) and one optimized from the
    recorded co-activation."""
    e, w = record.num_experts, topology.world_size
    out = {}
    if run_placement in NAMED:
        out[run_placement] = Placement.named(run_placement, e, topology)
    else:
        own = _file_placement(record, w, run_placement)
        if own is not None:
            out[placement_name(run_placement)] = own
    if not e & (e - 1):
        out.setdefault("tree_prefix", Placement.tree_prefix(e, topology))
    out["optimized"] = Placement.optimized(record.coactivation(), topology)
    return out


def _file_placement(record: RoutingRecord, world: int, path: str) -> Placement | None:
    """A placement file's experts as the run's dispatch recorded them (the file may have changed or moved
    since), else as the file holds them; None when neither is for ``world`` ranks."""
    run = record.dispatch
    if run is not None and Topology.parse(run["topology"]).world_size == world:
        placement = Placement(run["expert_to_rank"], world)
        if placement.num_experts != record.num_experts:
            raise ValueError(f"routing record: its dispatch places {placement.num_experts} experts, its routing "
                             f"chose among {record.num_experts}")
        return placement
    if Path(path).is_file():
        placement = Placement.from_yaml(path)
        if (placement.num_experts, placement.world_size) == (record.num_experts, world):
            return placement
    return None


def analyze(record: RoutingRecord, topology: Topology, run_placement: str = "contiguous") -> dict:
    w = topology.world_size
    if record.num_experts % w:
        raise ValueError(f"{record.num_experts} experts do not divide over {w} ranks ({topology.describe()}); "
                         "pick a topology whose rank count divides the expert count, or use `dist-moe simulate`")
    t = record.expert_idx.shape[0]
    src = record.src_rank if record.world_size == w else torch.arange(t) % w
    placements = _placements(record, topology, run_placement)
    name = placement_name(run_placement)
    out: dict = {"topology": topology.describe(), "tokens": t, "token_bytes": record.token_bytes,
           "num_experts": record.num_experts, "run_placement": run_placement,
           "run_placement_shown": name if name in placements else None, "placements": {}}
    lower = record.token_bytes * (1 - 1 / topology.num_nodes) if topology.num_nodes > 1 else 0.0
    out["node_lower_bound_bytes_per_token"] = lower
    heat = record.dispatch["dedup"] if record.dispatch is not None else "rank"  # the heatmap shows the run's mode
    out["heatmap_dedup"] = heat
    for name, placement in placements.items():
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
    # the flat layout the run's is read against: contiguous placement, one copy per (token, expert)
    flat = dispatch_traffic(record.expert_idx, src, Placement.contiguous(record.num_experts, w), topology,
                            record.token_bytes, "none")
    out["flat_bytes_per_token_by_level"] = {k: v / t for k, v in flat.by_level().items()}
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
        distance = tree_distance(record.expert_idx, e)
        if math.isfinite(distance):  # NaN when no token kept two experts: no co-selected pair to measure
            out["tree_distance"] = distance
        out["random_pair_tree_distance"] = random_pair_tree_distance(e)
    return out


def _node_share(record: RoutingRecord, expert_node: torch.Tensor, num_nodes: int) -> dict:
    idx = record.expert_idx
    share, cv = node_share(torch.bincount(idx[idx >= 0], minlength=record.num_experts), expert_node, num_nodes)
    return {"node_share": share, "node_share_cv": cv if math.isfinite(cv) else None}  # None: no slot dispatched


def _training(run_dir: Path) -> dict:
    """The training rows of the run's metrics.jsonl the report plots and sums (a torn last row, which a
    killed run leaves, skipped: ``torn_last_row`` gives its line)."""
    path = run_dir / "metrics.jsonl"
    rows, torn = read_jsonl(path, "metrics file") if path.exists() else ([], None)
    steps = [(number, r) for number, r in rows if "loss" in r]
    for number, r in steps:
        problem = _metric_problem(r)
        if problem:
            raise ValueError(f"metrics file {path}: line {number}: {problem}")
    rows_kept = [r for _, r in steps]
    return {
        "steps": [r["step"] for r in rows_kept],
        "tree_distance": [r.get("tree_distance") for r in rows_kept],  # the mean over MoE layers when several
        "measured_bytes_by_level": {k[len("bytes_"):]: sum(r.get(k, 0) for r in rows_kept)
                                    for k in sorted({k for r in rows_kept for k in r if k.startswith("bytes_")})},
        "torn_last_row": torn,
    }


def _metric_problem(row: dict) -> str | None:
    """What is wrong with a training row's step, tree distance or byte counts (None: nothing)."""
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    if not is_int(row.get("step")):
        return f"'step' must be an int, got {reprlib.repr(row.get('step'))}"
    distance = row.get("tree_distance")
    if distance is not None and (isinstance(distance, bool) or not isinstance(distance, (int, float))):
        return f"'tree_distance' must be a number or null, got {reprlib.repr(distance)}"
    counts = [(k, v) for k, v in row.items() if k.startswith("bytes_") and not (is_int(v) and v >= 0)]
    return f"{counts[0][0]!r} must be a count of bytes (an int >= 0), got {reprlib.repr(counts[0][1])}" \
        if counts else None


def write_report(run_dir: str | Path, topology: Topology, run_placement: str = "contiguous",
                 topology_source: str = "given", rates_source: str | None = None) -> dict:
    """Write report.json, report.md and the PNGs into ``run_dir``; returns the report (the first MoE
    layer's analysis at the top, every layer's under "layers"). ``topology_source`` says where the
    topology came from (given, the run's own, assumed); ``rates_source`` where its link rates did
    when they are not the cost model's defaults: a file, "calibrated <date> (file)" for calibrate's."""
    run_dir = Path(run_dir)
    check_outputs(run_dir)
    layers = [analyze(RoutingRecord.load(run_dir, i), topology, run_placement)
              for i in range(max(1, recorded_layers(run_dir)))]
    report = dict(layers[0])
    kept = ("placements", "run_dispatch", "expert_load", "tree_distance", "flat_bytes_per_token_by_level")
    report["layers"] = [{k: v for k, v in a.items() if k in kept} for a in layers]
    report["topology_source"] = topology_source
    default = topology.cost == CostModel.default(topology.levels)
    source = "the cost model's defaults" if default else rates_source or "given"
    kind = "default link rates" if default else "calibrated" if source.startswith("calibrated") else "given link rates"
    report["link_rates"] = {"source": source, "kind": kind, "default": default, "levels": link_rates(topology)}
    report["training"] = _training(run_dir)
    report["run_against_flat"] = run_against_flat(report, topology.levels[0])
    shown = report["run_placement_shown"] or next(iter(report["placements"]))
    whose = " (the run's)" if shown == report["run_placement_shown"] else ""
    report["heatmap"] = {"placement": shown, "dedup": report["heatmap_dedup"],
                         "title": f"dispatch KiB, layer 0, {shown} placement{whose}, {report['heatmap_dedup']} dedup"}
    # strict JSON: a NaN or inf here is a bug to refuse, never a file other tools cannot read
    text, markdown = json.dumps(report, indent=1, allow_nan=False) + "\n", _markdown(report, topology)
    _plots(run_dir, report, topology)
    write_atomic(run_dir / "report.json", text)
    write_atomic(run_dir / "report.md", markdown)
    return report


def run_against_flat(report: dict, level: str) -> dict | None:
    """The bytes per token crossing ``level`` (summed over the MoE layers) of the run's placement and dedup, and
    of contiguous placement without dedup on the same routing: what the run's layout saves on its own router's
    choices (None where the run's placement or dedup is not known)."""
    own, run = report["run_placement_shown"], report.get("run_dispatch")
    if own is None or run is None:
        return None
    mine = sum(layer["placements"][own]["modes"][run["dedup"]]["bytes_per_token_by_level"][level]
               for layer in report["layers"])
    flat = sum(layer["flat_bytes_per_token_by_level"][level] for layer in report["layers"])
    return {"placement": own, "dedup": run["dedup"], "level": level, "bytes_per_token": mine,
            "flat_bytes_per_token": flat, "ratio": mine / flat if flat else None}


def against_flat_sentence(report: dict) -> str | None:
    """``run_against_flat`` in one sentence."""
    r = report.get("run_against_flat")
    if r is None or r["ratio"] is None:
        return None
    return (f"Bytes per token crossing the {r['level']} level: the run's {r['placement']} placement with "
            f"{r['dedup']} dedup sends {r['bytes_per_token']:.1f} against {r['flat_bytes_per_token']:.1f} for "
            f"contiguous placement without dedup on the same routing ({r['ratio']:.2f}x).")


def check_outputs(run_dir: str | Path) -> None:
    """Refuse, before the analysis, a run directory the report's files could not be written into."""
    for name in OUTPUTS:
        check_output_file(Path(run_dir) / name, "report file")


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.3g} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.3g} MB/s"


def link_rates(topology: Topology) -> str:
    """The links an estimate prices, per level: bandwidth, alpha per peer, and whether the link is shared."""
    return "; ".join(f"{name} {_rate(c.bandwidth_Bps)}{' shared' if c.shared else ' per rank'}, "
                     f"{1e6 * c.alpha_s:.3g} us per peer" for name, c in topology.cost.levels.items())


def rates_sentence(report: dict) -> str:
    """Where the time estimates' link rates come from, and how to price them on the real links."""
    rates = report["link_rates"]
    if rates["default"]:
        return (f"Times price one dispatch all-to-all on the cost model's default link rates ({rates['levels']}), "
                "not on this cluster's: for those, run `dist-moe calibrate` on the cluster and give its YAML "
                "to `dist-moe report --topology FILE` (or save it as calibrated_topology.yaml in the run "
                "directory).")
    return f"Times price one dispatch all-to-all on the link rates of {rates['source']} ({rates['levels']})."


def _markdown(report: dict, topology: Topology) -> str:
    levels = list(topology.levels)
    own = report["run_placement_shown"]
    placed = (f"the run used `{report['run_placement']}` placement (rows marked *run*)" if own else
              f"the run used `{report['run_placement']}` placement, which is not shown: neither the run's "
              f"dispatch record nor that file places its experts on {report['topology']}'s ranks")
    lines = [f"# Communication report: {report['tokens']} tokens on {report['topology']}", "",
             f"Topology {report['topology']}: {report['topology_source']}.", "",
             f"{report['num_experts']} experts, {report['token_bytes']} B per token copy; {placed}. Bytes per "
             "token in the dispatch direction (the combine returns the same), for each MoE layer. "
             + rates_sentence(report), "",
             "| layer | placement | dedup | " + " | ".join(f"{lv} B/token" for lv in levels)
             + f" | est. all-to-all ({report['link_rates']['kind']}) |",
             "|---|---|---|" + "---|" * len(levels) + "---|"]
    for li, layer in enumerate(report["layers"]):
        for name, p in layer["placements"].items():
            for dedup, m in p["modes"].items():
                cells = " | ".join(f"{m['bytes_per_token_by_level'][lv]:.1f}" for lv in levels)
                shown = f"{name} (*run*)" if name == own else name
                lines.append(f"| {li} | {shown} | {dedup} | {cells} | {1e6 * m['estimated_seconds']:.1f} us |")
    lines += ["", f"Lower bound across nodes: {report['node_lower_bound_bytes_per_token']:.1f} B/token "
              "(one copy to one other node)."]
    against = against_flat_sentence(report)
    if against:
        lines.append(against)
    if topology.num_nodes > 1 and len(levels) > 1:
        lines.append(f"Node dedup sends a token once to each node that holds its experts, to one rank there, "
                     f"which forwards it to that node's other ranks holding them: bytes across nodes fall, and "
                     f"bytes crossing the {levels[1]} level inside a node rise by that forwarding.")
    if topology.num_nodes > 1:  # the slots the dispatch sends; the training summary's are the router's load
        lines.append("Node share (each node's share of the validation slots dispatched, after capacity drops; "
                     "the training summary's node share is of the router's load before them): " + "; ".join(
                         f"layer {li} {name} " + " / ".join(f"{v:.3f}" for v in p["node_share"])
                         + (f" (CV {p['node_share_cv']:.3f})" if p["node_share_cv"] is not None else " (CV n/a)")
                         for li, layer in enumerate(report["layers"]) for name, p in layer["placements"].items())
                     + ".")
    distances = [(li, layer["tree_distance"]) for li, layer in enumerate(report["layers"]) if "tree_distance" in layer]
    if distances:
        lines.append("Tree distance of co-selected experts (validation): "
                     + ", ".join(f"layer {li} {d:.3f}" for li, d in distances)
                     + f" (random pairs {report['random_pair_tree_distance']:.3f}). Over training "
                     "(tree_distance.png) an unlimited router's co-selected experts may drift apart: BRANCH's tree "
                     "moves siblings' scores together at initialisation (16 experts, top-4, random inputs: 0.73 "
                     "against 0.82 for random pairs), and nothing in the loss keeps them close as it learns; "
                     "`router.subtree_limit` keeps each token's experts in one subtree.")
    run = report.get("run_dispatch")
    if run:
        lines.append(f"The run's own dispatch (dedup={run['dedup']}) of these tokens, layer 0: measured "
                     + ", ".join(f"{k} {v:,} B" for k, v in run["measured_bytes_by_level"].items())
                     + "; analytic " + ", ".join(f"{k} {v:,} B" for k, v in run["analytic_bytes_by_level"].items())
                     + ".")
    measured = report["training"]["measured_bytes_by_level"]
    if measured:
        lines.append("Measured during training (all ranks, all MoE layers, all logged steps): "
                     + ", ".join(f"{k} {v:,} B" for k, v in measured.items()) + ".")
    lines += ["", f"![{report['heatmap']['title']}](traffic_heatmap.png)", "![bytes per level](bytes_by_level.png)",
              "![tokens per expert, every MoE layer](expert_load.png)", "![tree distance](tree_distance.png)", ""]
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
    # matplotlib: optional and slow to import, only when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heat = report["heatmap"]
    matrix = torch.tensor(report["placements"][heat["placement"]]["modes"][heat["dedup"]]["matrix"],
                          dtype=torch.float64)
    kib = (matrix / 1024).numpy()
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    im = ax.imshow(kib, cmap="viridis")
    title, _, rest = heat["title"].partition(", ")  # two lines: a long placement name is not cut off
    ax.set_title(f"{title}\n{rest}", fontsize=10)
    ax.set(xlabel="destination rank", ylabel="source rank")
    ticks = range(0, matrix.shape[0], max(1, matrix.shape[0] // 16))  # whole ranks, at most 16 labels
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    if matrix.shape[0] <= 16:  # each cell's KiB written in it, dark on light cells and light on dark
        top = float(kib.max()) or 1.0
        for i, row in enumerate(kib.tolist()):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=8,
                        color="black" if value > 0.6 * top else "white")
    per_node = topology.world_size // topology.num_nodes if topology.world_size == matrix.shape[0] else 0
    for edge in range(per_node, matrix.shape[0], per_node or matrix.shape[0]):  # node boundaries
        ax.axhline(edge - 0.5, color="white", lw=1.5)
        ax.axvline(edge - 0.5, color="white", lw=1.5)
    if 0 < per_node < matrix.shape[0]:
        ax.set_xlabel("destination rank (white lines: node boundaries)")
    fig.colorbar(im, ax=ax, label="KiB sent")
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
    loads = [layer["expert_load"] for layer in report["layers"]]
    width = 0.8 / len(loads)
    for li, load in enumerate(loads):  # every MoE layer, side by side
        ax.bar([e + (li - (len(loads) - 1) / 2) * width for e in range(len(load))], load, width, label=f"layer {li}")
    which = "its one MoE layer" if len(loads) == 1 else f"each of its {len(loads)} MoE layers"
    ax.set(title=f"tokens per expert, validation, {which}", xlabel="expert", ylabel="tokens")
    if len(loads) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, run_dir / "expert_load.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3))
    tr = report["training"]
    pts = [(s, d) for s, d in zip(tr["steps"], tr["tree_distance"]) if d is not None]
    if pts:
        n = len(report["layers"])  # with several MoE layers the logged value is their mean
        ax.plot(*zip(*pts), label=f"co-selected experts, mean of {n} layers" if n > 1 else "co-selected experts")
    if "random_pair_tree_distance" in report:
        ax.axhline(report["random_pair_tree_distance"], color="k", ls="--", lw=1, label="random pairs")
    ax.set_title("normalised tree distance of co-selected experts, training batches\n"
                 "(lower: closer in the expert tree, so fewer bytes cross nodes under tree-prefix placement;\n"
                 "a rise: the router spreading its choices as it learns, report.md says why)", fontsize=9)
    ax.set(xlabel="step", ylabel="tree distance (lower is better)")
    ax.legend()
    fig.tight_layout()
    _save(fig, run_dir / "tree_distance.png")
    plt.close(fig)
