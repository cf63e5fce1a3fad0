"""`dist-moe plan`: bytes per level and predicted MoE time per step on a cluster that does not exist yet.

    dist-moe plan --topology node=2048,gpu=8 --link gpu=450GB/s --link node=400Gb/s@5us \\
        --hidden 7168 --ffn 2048 --experts 256 --top-k 8 --tokens-per-rank 8192 --layers 58
    dist-moe plan --config configs/lm_branch.yaml --topology node=2,gpu=8     (the shape a train config trains)

The arithmetic is ``placement/forecast.py``'s; this file parses, prints and plots.
"""
from __future__ import annotations

import json
import re
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from dist_moe.cli.topology_arg import topology_of
from dist_moe.config.choices import MAX_PIPELINE_CHUNKS
from dist_moe.errors import shown
from placement import check_output_file
from placement.activations import activation_bytes
from placement.cost import in_bounds, in_range
from placement.files import replacing
from placement.forecast import DTYPE_BYTES, PLACEMENTS, WIRES, ModelShape, ep_topology, forecast
from placement.layouts import price_layouts
from placement.placement import Placement
from placement.simulate import RoutingRecord

_NUMBER = r"((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)"  # what float() reads, without a sign, nan or inf
_RATE = re.compile(rf"^{_NUMBER}\s*([kMGT]?)(B|b)/s$")
_TIME = re.compile(rf"^{_NUMBER}\s*(s|ms|us|ns)$")
_PREFIX = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_SECONDS = {"s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def add_parser(sub, debug) -> None:
    pp = sub.add_parser("plan", parents=[debug], help="bytes per level and predicted step time on a planned cluster")
    pp.add_argument("--topology", required=True, help="node=2048,gpu=8 (rack=...,node=...,gpu=...) or a topology YAML")
    pp.add_argument("--link", action="append", default=[], metavar="LEVEL=RATE[@LATENCY]",
                    help="a level's link per rank, e.g. gpu=450GB/s, node=400Gb/s@5us (default: the cost model's)")
    pp.add_argument("--shared", action="append", default=[], metavar="LEVEL",
                    help="that level's link is shared by the ranks of a unit inside it (one NIC per node); "
                         "repeatable (default: a topology YAML's setting, else a link per rank)")
    pp.add_argument("--config", help="a dist-moe train config (YAML): the model shape it trains, which the flags "
                                     "below then change (default: none; give the shape's flags)")
    for name, what in (("hidden", "the model's hidden size (values per token copy)"),
                       ("ffn", "each expert's FFN hidden size (SwiGLU: 3 matrices of hidden x ffn)"),
                       ("experts", "experts per MoE layer"),
                       ("top-k", "experts each token is routed to"),
                       ("tokens-per-rank", "tokens each rank routes per MoE layer and step")):
        pp.add_argument(f"--{name}", type=int, help=f"{what} (default: --config's; one of the two is needed)")
    pp.add_argument("--layers", type=int, help="MoE layers per step (default: --config's, else 1)")
    pp.add_argument("--dtype", help="bf16, fp16, fp32 or fp8: the wire's bytes per hidden value, fp8 with one fp32 "
                                    "scale per 128 (default: --config's parallel.wire_dtype, else its precision as "
                                    "a GPU trains it, auto: bf16; else bf16)")
    pp.add_argument("--routing", default="uniform",
                    help="uniform (default) or a run directory whose recorded routing (routing.npz) is tiled "
                         "over the experts")
    pp.add_argument("--ep", type=int, help="expert-parallel group size (default: gcd(ranks, experts))")
    pp.add_argument("--tflops", type=float, default=400.0,
                    help="achieved TFLOP/s of the expert matmuls per rank, 0.001 to 1e6 (default 400)")
    pp.add_argument("--placement", action="append", choices=PLACEMENTS,
                    help="placements to compare (default: all that apply)")
    pp.add_argument("--sample", type=int, help="tokens routed per rank to count copies (default: 8,192 in all)")
    pp.add_argument("--pipeline-chunks", default="1,4", metavar="C[,C]",
                    help=f"pipeline settings to compare (parallel.pipeline_chunks, each 1 to {MAX_PIPELINE_CHUNKS}; "
                         "default 1,4)")
    pp.add_argument("--overlap", type=float,
                    help="share of the shorter of exchanges and matmuls a pipelined layer hides, in [0, 1] "
                         "(default: the topology YAML's calibrated value, else 0: pipelining assumed to hide nothing)")
    pp.add_argument("--memory", type=float, default=80.0,
                    help="GiB of memory per rank for the experts' fp32 weights, gradients and Adam state (and the "
                         "replicated weights'), which decides the layouts that fit (default 80, an H100's)")
    pp.add_argument("--dense-params", type=int, default=0,
                    help="the model's replicated (non-expert) parameters: their gradient sum over every rank is "
                         "priced in each layout's step (default 0: left out; the same in every layout)")
    pp.add_argument("--plot", help="write a PNG of the predicted step time per placement and dedup here "
                                   "(default: no plot)")
    pp.add_argument("--json", action="store_true", help="print the result as JSON")


def _rate(text: str) -> float:
    m = _RATE.match(text.strip())
    if not m:
        raise ValueError(f"--link rate {text!r}: give a number and a unit such as 450GB/s or 400Gb/s")
    value = float(m.group(1)) * _PREFIX[m.group(2)]
    return value if m.group(3) == "B" else value / 8


def _seconds(text: str) -> float:
    m = _TIME.match(text.strip())
    if not m:
        raise ValueError(f"--link latency {text!r}: give a number and a unit such as 5us")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def topology_with_links(spec: str, links: list[str], shared: list[str]):
    topo = topology_of(spec)
    overrides: dict = {}
    for item in links:
        name, _, rest = item.partition("=")
        rate, _, latency = rest.partition("@")
        if not name or not rate:
            raise ValueError(f"--link {item!r} must look like level=RATE[@LATENCY], e.g. node=400Gb/s@5us")
        link = {"bandwidth_Bps": _rate(rate), **({"alpha_s": _seconds(latency)} if latency else {})}
        overrides[name] = {key: in_bounds(key, value, f"--link {item}: {key}") for key, value in link.items()}
    for name in shared:
        overrides.setdefault(name, {})["shared"] = True
    for name in overrides:
        if name not in topo.levels:
            raise ValueError(f"--link/--shared names level {name!r}; the topology's levels are {list(topo.levels)}")
    return type(topo)(topo.levels, topo.sizes, topo.cost.updated(overrides)) if overrides else topo


def recorded_routing(run_dir: str, experts: int, top_k: int):
    """Tokens drawn from a recorded run, each in a uniform replica block of its experts (as simulate)."""
    record = RoutingRecord.load(run_dir)
    e, k = record.num_experts, record.expert_idx.shape[1]
    if experts % e or k != top_k:
        raise ValueError(f"--routing {run_dir}: the run routed top-{k} of {e} experts; plan a multiple of {e} "
                         f"experts with --top-k {k}")

    return lambda tokens, g: record.sample(tokens, experts // e, g)[2]


def _chunks(text: str) -> tuple:
    parts = text.split(",")
    if not all(p.strip().isdigit() and 1 <= int(p) <= MAX_PIPELINE_CHUNKS for p in parts):
        raise ValueError(f"--pipeline-chunks {shown(text)}: give ints in [1, {MAX_PIPELINE_CHUNKS}] separated by "
                         "commas, e.g. 1,4")
    return tuple(int(p) for p in parts)


def run(args) -> int:
    start = time.time()
    if args.plot:
        check_output_file(args.plot, "--plot", make_folders=True)
    chunks = _chunks(args.pipeline_chunks)
    topo = topology_with_links(args.topology, args.link, args.shared)
    if args.overlap is not None:
        overlap = in_bounds("overlap", args.overlap, "--overlap")
        topo = type(topo)(topo.levels, topo.sizes, topo.cost.with_exchange(topo.cost.latency_s, overlap,
                                                                           topo.cost.chunked))
    shape = model_shape(args)
    routing = None if args.routing == "uniform" else recorded_routing(args.routing, shape.experts, shape.top_k)
    out = forecast(shape, topo, routing, args.ep, args.tflops, args.sample, tuple(args.placement or PLACEMENTS),
                   chunks=chunks)
    memory = in_range(args.memory, 1e-3, 1e6, "--memory", " GiB")
    dense = in_range(args.dense_params, 0, 1e15, "--dense-params")
    out.update(price_layouts(shape, topo, routing, args.tflops, args.sample, chunks, memory * 2**30, int(dense)))
    out["activation_bytes_per_layer"] = layer_activations(shape)
    out["seconds_to_plan"] = round(time.time() - start, 2)
    # strict JSON, made before the plot is written: every input is bounded to keep the numbers finite
    text = json.dumps(out, indent=1, allow_nan=False) if args.json else None
    # the table and the plot show the same rows, folded alike
    rows, fold_notes = folded_rows(out["rows"], placements_of(out, shape, topo), args.routing == "uniform")
    if args.plot:
        _plot(plot_bars(rows, fold_notes, out), f"{out['topology']}, EP {out['ep']}", Path(args.plot))
    if text is not None:
        print(text)
        return 0
    levels = list(out["rows"][0]["bytes_per_token_by_level"])
    print(f"{out['topology']}: EP groups of {out['ep']} ranks ({out['ep_group']}) x {out['replicas']}; "
          f"{shape.experts} experts top-{shape.top_k}, {shape.tokens_per_rank} tokens per rank, "
          f"{out['token_bytes']} B per copy, {args.routing} routing ({out['sample_per_rank']} sampled per rank)")
    print(f"experts' matmuls {1e3 * out['expert_seconds']:.2f} ms per layer (fwd+bwd at {args.tflops:g} TFLOP/s); "
          f"4 exchanges per layer (dispatch, combine; forward, backward); collective latency "
          f"{1e6 * topo.cost.latency_s:g} us, pipelined overlap {topo.cost.overlap:g}"
          + (" (uncalibrated: pipelining hides nothing, so C > 1 rows equal C = 1 plus their extra collectives' "
             "latency; set it with --overlap or a topology YAML from dist-moe calibrate)"
             if topo.cost.overlap == 0 else ""))
    top = levels[0]  # the slowest link's bytes on each wire dtype
    width = max(12, *(len(r["placement"]) + 1 for r in rows))
    print(f"{'placement':<{width}}{'dedup':<6}{'C':>3}" + "".join(f"{lv + ' B/token':>15}" for lv in levels)
          + "".join(f"{top + ' ' + w:>11}" for w in WIRES) + f"{'exchange ms':>13}{'step ms':>11}{'exposed ms':>12}")
    for r in rows:
        cells = "".join(f"{r['bytes_per_token_by_level'][lv]:>15.1f}" for lv in levels)
        wires = "".join(f"{r['bytes_per_token_by_wire'][w][top]:>11.1f}" for w in WIRES)
        times = (f"{1e3 * r['exchange_seconds']:>13.3f}{1e3 * r['step_seconds']:>11.2f}"
                 f"{1e3 * r['exposed_seconds']:>12.2f}")
        print(f"{r['placement']:<{width}}{r['dedup']:<6}{r['chunks']:>3}{cells}{wires}{times}")
    print(f"{top} fp32/bf16/fp8 = the {top} B/token column on each wire dtype (parallel.wire_dtype; fp8: e4m3 "
          f"values and one fp32 scale per 128); exchange ms = one exchange, of the 4 per layer per step; "
          f"step = {shape.layers} MoE layer(s) x "
          f"(4 exchanges + experts, C > 1 overlapped); exposed = the exchanges' time per step that the experts' "
          f"matmuls do not hide (step - matmuls: the plot's 'exposed ms' bar); planned in "
          f"{out['seconds_to_plan']} s after start-up"
          + (f"; plot: {args.plot}" if args.plot else ""))
    for note in fold_notes:
        print(f"note: {note}")
    for note in why_rows_agree(rows, shape.experts, out["ep"], args.routing):
        print(f"note: {note}")
    print(f"activations kept for backward: at most {out['activation_bytes_per_layer'] / 2**20:.1f} MiB per MoE layer "
          f"per rank ({shape.dtype} rows, every pair its own copy), "
          f"{shape.layers * out['activation_bytes_per_layer'] / 2**30:.2f} GiB for {shape.layers} layer(s)")
    print_layouts(out, topo, args.memory)
    return 0


def layer_activations(shape: ModelShape) -> int:
    """``placement.activations``' estimate for one MoE layer of ``shape`` on one rank that exchanges: rows in
    ``shape.dtype`` on the wire, the experts computing in it (bf16 under fp8, whose values are the wire's only)."""
    wire = DTYPE_BYTES[shape.dtype]
    return activation_bytes(shape, max(wire, 2), wire)


SHAPE_FIELDS = ("hidden", "ffn", "experts", "top_k", "tokens_per_rank", "layers", "dtype")  # ModelShape's, as flags


def model_shape(args) -> ModelShape:
    """The shape to plan: a train config's (``--config``), each flag given changing it; else the flags."""
    given = {field: getattr(args, field) for field in SHAPE_FIELDS if getattr(args, field) is not None}
    if args.config:
        from dist_moe.train.config import load_config
        from dist_moe.train.layout_choice import moe_shape

        return replace(moe_shape(load_config(args.config, [])), **given)
    missing = [f"--{field.replace('_', '-')}" for field in SHAPE_FIELDS[:5] if field not in given]
    if missing:
        raise ValueError(f"dist-moe plan needs {', '.join(missing)} (the model's shape), or --config with a train "
                         "config that has it")
    return ModelShape(**{"layers": 1, "dtype": "bf16", **given})


def print_layouts(out: dict, topo, memory_gib: float) -> None:
    """Every expert-parallel layout's predicted step, fastest first, and the one recommended."""
    levels = list(topo.levels)
    print(f"\nlayouts on {out['topology']} (each: its fastest placement / dedup / C; experts' gradients summed over "
          f"their replicas as a ring all-reduce, fp32, not hidden behind the backward):")
    rows = [f"{r['placement']}/{r['dedup']}/C={r['chunks']}" for r in out["layouts"]]
    gw = max(7, *(len(r["group"]) + 1 for r in out["layouts"]))  # columns as wide as their longest entry
    rw = max(4, *(len(row) + 1 for row in rows))
    print(f"{'ep_size':>8} {'layout':<11}{'groups':<{gw}}{'row':<{rw}}{'MoE ms':>11}{'grad ms':>11}"
          + "".join(f"{'grad ' + lv + ' MB':>15}" for lv in levels) + f"{'step ms':>12}{'GiB':>8}")
    for r, row in zip(out["layouts"], rows):
        grads = "".join(f"{r['grad_bytes_by_level'][lv] / 1e6:>15.1f}" for lv in levels)
        print(f"{r['ep']:>8} {r['layout']:<11}{r['group']:<{gw}}{row:<{rw}}{1e3 * r['moe_seconds']:>11.2f}"
              f"{1e3 * r['grad_seconds']:>11.2f}{grads}{1e3 * r['step_seconds']:>12.2f}"
              f"{r['memory_bytes'] / 2**30:>8.1f}" + ("" if r["fits"] else f"  (over {memory_gib:g} GiB)"))
    best = out["recommended"]
    if best is None:
        print(f"recommended: none fits {memory_gib:g} GiB per rank (--memory)")
    else:
        print(f"recommended: parallel.ep_size={best['ep']} parallel.ep_layout={best['layout']} "
              f"({1e3 * best['step_seconds']:.2f} ms per step)")


RECORDED_HINT = "--routing RUN_DIR (a recorded run's routing) tells placements apart"


def placements_of(out: dict, shape: ModelShape, topo) -> dict[str, Placement]:
    """Each planned placement's expert -> rank map on one EP group (placements that are the same map fold)."""
    group = ep_topology(topo, out["ep"])
    return {name: Placement.named(name, shape.experts, group) for name in dict.fromkeys(r["placement"]
                                                                                         for r in out["rows"])}


def folded_rows(rows: list[dict], placements: dict[str, Placement], uniform: bool) -> tuple[list[dict], list[str]]:
    """The rows to show, each fold of placements once (named for all, as ``a=b``, with the first's numbers),
    and a note for each fold saying what it stands for and why. Placements fold when they put every expert
    on the same rank; under uniform routing they all fold: every placement gives each rank as many experts
    (``Placement`` refuses any other), so one is another with its experts renumbered, which uniform routing
    cannot tell apart, and their rows differ by the sampled tokens' noise alone."""
    by_placement: dict[str, list[dict]] = {}
    for r in rows:
        by_placement.setdefault(r["placement"], []).append(r)
    same_map = _grouped([[n] for n in by_placement], lambda g: tuple(placements[g[0]].expert_to_rank))
    folds = [same_map] if uniform else [[g] for g in same_map]
    shown, notes = [], []
    for fold in folds:
        names = [n for group in fold for n in group]
        shown += [{**r, "placement": "=".join(names)} for r in by_placement[names[0]]]
        if len(names) > 1:
            first = placements[names[0]]
            notes.append(_fold_note(fold, by_placement, first.num_experts // first.world_size))
    return shown, notes


def _grouped(items: list[list], key) -> list[list]:
    """``items`` (lists) concatenated where their ``key`` agrees, in order of first appearance."""
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).extend(item)
    return list(groups.values())


def _fold_note(fold: list[list[str]], by_placement: dict, per_rank: int) -> str:
    names = [n for group in fold for n in group]
    first = names[0]
    why = [f"{_listed(group)} put every expert on the same rank" for group in fold if len(group) > 1]
    if len(fold) > 1:
        others = names[len(fold[0]):]
        spread = max(_spread(by_placement[first], by_placement[n]) for n in others)
        why.append(f"under uniform routing the bytes depend only on how many experts each rank holds ({per_rank} "
                   f"on every rank here), so placement does not change them ({_listed(others)}: within "
                   f"{100 * spread:.2g}% of {first}'s, the sampled tokens' noise); {RECORDED_HINT}")
    return f"{'='.join(names)} stands for {_listed(names)}, shown once with {first}'s numbers: " + "; ".join(why)


def _spread(rows: list[dict], others: list[dict]) -> float:
    """The largest relative difference of two placements' bytes per token, over rows and levels."""
    theirs = {(r["dedup"], r["chunks"]): _bytes_of(r) for r in others}
    return max((abs(x - y) / max(abs(x), abs(y), 1e-9) for r in rows
                for x, y in zip(_bytes_of(r), theirs[r["dedup"], r["chunks"]])), default=0.0)


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


class Bars(NamedTuple):
    """What the plot draws: a bar per table row (its label, exposed exchanges and matmuls, ms per step) and
    the table's fold notes as its caption."""
    labels: list[str]
    exposed_ms: list[float]
    matmul_ms: list[float]
    notes: list[str]


def plot_bars(rows: list[dict], notes: list[str], out: dict) -> Bars:
    """The plot of the table's ``rows`` (folded, as printed) and its fold ``notes``."""
    matmuls = 1e3 * out["expert_seconds"] * out["layers"]
    return Bars([f"{r['placement']} / {r['dedup']} / C={r['chunks']}" for r in rows],
                [1e3 * r["exposed_seconds"] for r in rows], [matmuls] * len(rows), notes)


def _bytes_of(r: dict) -> tuple:
    return tuple(r["bytes_per_token_by_level"].values())


def _close(a: tuple, b: tuple) -> bool:
    """Within 1%: rows that differ by the sampled tokens' noise alone."""
    return all(abs(x - y) <= 0.01 * max(abs(x), abs(y), 1e-9) for x, y in zip(a, b))


def why_rows_agree(rows: list[dict], experts: int, ep: int, routing: str) -> list[str]:
    """What makes rows of the table (as shown: folded) equal, said where it happens (1% apart or less:
    sampling noise). Under uniform routing such placements are folded, and the fold's note says why."""
    notes = []
    by_setting: dict = {}
    for r in rows:
        by_setting.setdefault((r["dedup"], r["chunks"]), []).append(_bytes_of(r))
    if (routing != "uniform" and len(rows) > len(by_setting)
            and all(_close(v[0], w) for v in by_setting.values() for w in v)):
        notes.append("every placement moves the same bytes (within 1%): the recorded routing's co-activation "
                     "does not favour one placement here")
    same = [r for r in rows if r["dedup"] == "rank"]
    none = {(r["placement"], r["chunks"]): _bytes_of(r) for r in rows if r["dedup"] == "none"}
    if same and all((r["placement"], r["chunks"]) in none and _close(_bytes_of(r), none[r["placement"], r["chunks"]])
                    for r in same):
        notes.append("dedup rank sends what none sends: "
                     + (f"{experts} experts on {ep} ranks is one expert per rank, so no token has two experts "
                        "on one rank" if experts <= ep else
                        f"with {experts} experts on {ep} ranks few tokens have two experts on one rank"))
    return notes


def _plot(bars: Bars, title: str, path: Path) -> None:
    # matplotlib: optional and slow to import, only when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.45 * len(bars.labels) + 1.5))
    ax.barh(bars.labels, bars.exposed_ms, label="exposed ms: the exchanges the matmuls do not hide")
    ax.barh(bars.labels, bars.matmul_ms, left=bars.exposed_ms, label="experts' matmuls")
    ax.invert_yaxis()
    ax.set_xlabel("predicted MoE time per step (ms)")
    ax.set_title(title, pad=30)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    if bars.notes:  # the table's fold notes, under the axis in points: the same place at any number of bars
        caption = "\n".join(textwrap.fill(f"note: {n}", 110) for n in bars.notes)
        ax.annotate(caption, xy=(0, 0), xycoords="axes fraction", xytext=(0, -40), textcoords="offset points",
                    va="top", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as f:  # the path as given (a name without .png included), never through a link
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
