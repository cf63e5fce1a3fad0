"""`dist-moe report | place | simulate`: communication cost of a run's recorded routing."""
from __future__ import annotations

import fcntl
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

from dist_moe.train.rundir import LOCK, METRICS
from placement import Placement, Topology
from placement.cost import CostModel
from placement.exact import EXACT_MAX_EXPERTS, exact_placement
from placement.files import check_output_file, read_yaml
from placement.placement import NAMED as PLACEMENTS
from placement.report import link_rates, write_report
from placement.simulate import RoutingRecord, simulate
from placement.traffic import DEDUP_MODES, dispatch_traffic


def add_parsers(sub, debug) -> None:
    rp = sub.add_parser("report", parents=[debug],
                        help="report.json, report.md and PNG plots of a run's communication cost")
    rp.add_argument("run_dir", help="a run directory written by dist-moe train (its routing.npz and config.yaml); "
                                    "the report files are written into it")
    rp.add_argument("--topology", help="node=2,gpu=4 or a topology YAML such as dist-moe calibrate's, whose link "
                                       "rates then price the exchanges (default: the topology the run recorded, "
                                       f"else the run directory's {CALIBRATION}, else an assumed 2 nodes x 2 GPUs, "
                                       "which the report says)")
    pl = sub.add_parser("place", parents=[debug], help="an expert placement optimized from a run's co-activation")
    pl.add_argument("--topology", required=True, help="node=2,gpu=4 or a topology YAML")
    pl.add_argument("--stats", required=True, help="a run directory (its routing.npz)")
    pl.add_argument("--out", default="placement.yaml",
                    help="the placement file to write, for parallel.placement=FILE (default: %(default)s)")
    pl.add_argument("--exact-seconds", type=float, default=5.0,
                    help="time limit of each level's exact partition (CP-SAT, up to 64 experts); 0: heuristic only "
                         "(default: %(default)s)")
    sm = sub.add_parser("simulate", parents=[debug], help="replay a run's routing on a simulated cluster")
    sm.add_argument("--topology", help="node=128,gpu=8 (rack=...,node=...,gpu=...) or a topology YAML such as "
                                       "dist-moe calibrate's, whose link rates then price the exchanges (default: "
                                       "--nodes x --gpus-per-node on the cost model's default link rates)")
    sm.add_argument("--nodes", type=int, help="nodes (per rack with --racks); with --topology FILE, its link rates at "
                                              "these sizes (default: --topology's sizes)")
    sm.add_argument("--gpus-per-node", type=int, help="ranks per node (default: --topology's)")
    sm.add_argument("--racks", type=int, help="racks of --nodes nodes each (a rack x node x gpu topology; "
                                              "default: no rack level, node x gpu)")
    sm.add_argument("--subtree-limit", help="replay the recorded probabilities with BRANCH's subtree limit too: "
                                            "M (the node level) or level=M[,level=M], e.g. rack=1,node=2 "
                                            "(default: the recorded routing only)")
    sm.add_argument("--stats", required=True, help="a run directory (its routing.npz)")
    sm.add_argument("--placement", default="tree_prefix", choices=PLACEMENTS,
                    help="how the simulated experts are placed (default: %(default)s)")
    sm.add_argument("--tokens-per-rank", type=int, default=256,
                    help="recorded tokens drawn for each simulated rank (default: %(default)s)")
    sm.add_argument("--json", action="store_true", help="print the result as JSON")


def _limit(spec: str | None):
    """``--subtree-limit``: None, an int (the node level), or level=M[,level=M]."""
    if spec is None:
        return None
    if spec.isdigit() and int(spec) >= 1:
        return int(spec)
    out = {}
    for part in spec.split(","):
        name, _, m = part.partition("=")
        if not name.strip() or name.strip().isdigit() or not m.strip().isdigit() or int(m) < 1:
            raise ValueError(f"--subtree-limit {spec!r}: give M or level=M[,level=M] with M >= 1")
        out[name.strip()] = int(m)
    return out


CALIBRATION = "calibrated_topology.yaml"  # dist-moe calibrate's --out default; a run directory's is its links'


def topology_of(spec: str | None, record: RoutingRecord | None = None) -> Topology:
    """The given topology (node=2,gpu=4 or a YAML); else the run's own (expert-parallel runs record it); else
    2 nodes x 2."""
    if spec:
        return Topology.from_yaml(spec) if Path(spec).is_file() or spec.endswith((".yaml", ".yml")) else \
            Topology.parse(spec)
    if record is not None and record.dispatch is not None:
        return Topology.parse(record.dispatch["topology"])
    w = record.world_size if record is not None else 1
    if w >= 4 and w % 2 == 0:
        return Topology(("node", "gpu"), (2, w // 2))
    return Topology(("node", "gpu"), (2, 2))


def run(args) -> int:
    return {"report": _report, "place": _place, "simulate": _simulate}[args.command](args)


def _run_placement(run_dir: Path) -> str:
    cfg = run_dir / "config.yaml"
    if not cfg.exists():
        return "contiguous"
    data = read_yaml(cfg, "run config") or {}
    parallel = data.get("parallel") or {} if isinstance(data, dict) else None
    placement = parallel.get("placement", "contiguous") if isinstance(parallel, dict) else None
    if not isinstance(placement, str):
        raise ValueError(f"run config {cfg}: parallel.placement must be a placement name or file")
    return placement


def rates_origin(path: str | Path) -> str:
    """How a topology YAML's link rates were had: calibrate stamps its fits."""
    stamp = (read_yaml(path, "topology").get("exchange") or {}).get("calibrated")
    return f"calibrated {stamp} ({path})" if stamp else str(path)


def report_topology(spec: str | None, record: RoutingRecord, run_dir: Path) -> tuple[Topology, str, str | None]:
    """The report's topology, where it comes from, and where its link rates do (None: the defaults). Link
    rates: a given YAML's, else the run directory's calibration when it has the topology's shape."""
    calibration = run_dir / CALIBRATION
    if calibration.is_symlink():  # a run file that leads elsewhere is not the run's
        raise ValueError(f"{calibration} is a symlink: put the calibration file itself there")
    if spec and (Path(spec).is_file() or spec.endswith((".yaml", ".yml"))):
        return Topology.from_yaml(spec), f"given ({spec})", rates_origin(spec)
    calibrated = Topology.from_yaml(calibration) if calibration.exists() else None
    if spec:
        topo, source = Topology.parse(spec), f"given (--topology {spec})"
    elif record.dispatch is not None:
        topo, source = Topology.parse(record.dispatch["topology"]), "the run's own, recorded with its routing"
    elif calibrated is not None:
        topo, source = calibrated, f"the run's calibration ({calibration})"
    else:
        topo = topology_of(None, record)
        processes = "1 process" if record.world_size == 1 else f"{record.world_size} processes"
        source = (f"assumed, as the run ({processes}) recorded none"
                  + (f" (its tokens are dealt round-robin over these {topo.world_size} ranks)"
                     if record.world_size != topo.world_size else "")
                  + f"; give the real one with `dist-moe report {run_dir} --topology node=N,gpu=G` (or a "
                    "topology YAML)")
    if calibrated is not None and (calibrated.levels, calibrated.sizes) == (topo.levels, topo.sizes):
        return Topology(topo.levels, topo.sizes, calibrated.cost), source, rates_origin(calibration)
    return topo, source, None


def warn(text: str) -> None:
    """One warning line on stderr, in one write (as errors.report writes an error's line)."""
    sys.stderr.write(f"dist-moe: warning: {' '.join(text.split())}\n")
    sys.stderr.flush()


def still_training(run_dir: Path) -> bool:
    """Whether a run holds ``run_dir``'s lock (rundir.RunLock: an exclusive flock for the run's life). Probed
    with a shared flock released at once: a run starting in that instant is refused as if one were running."""
    try:
        fd = os.open(run_dir / LOCK, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # no lock file: no run trained here; a link: no run's lock
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the probe's lock


def _report(args) -> int:
    run_dir = Path(args.run_dir)
    training = still_training(run_dir)  # before the files are read: then they may be a live run's
    topo, source, rates = report_topology(args.topology, RoutingRecord.load(run_dir), run_dir)
    report = write_report(run_dir, topo, _run_placement(run_dir), source, rates)
    if training:
        warn(f"the run in {run_dir} is still in progress (it holds {run_dir / LOCK}): this report is a snapshot of "
             "its metrics so far, and its routing record may be from an earlier run")
    torn = report["training"]["torn_last_row"]
    if torn is not None:
        warn(f"{run_dir / METRICS} line {torn} is cut short (a run stopped while writing its last row): the report "
             "leaves that row out")
    outer = topo.levels[0]
    print(f"topology {report['topology']}: {source}")
    print(f"{report['tokens']} tokens, {report['num_experts']} experts: B/token crossing {outer} "
          "(none / rank / node dedup)")
    own = report["run_placement_shown"]
    for li, layer in enumerate(report["layers"]):
        for name, p in layer["placements"].items():
            cells = " / ".join(f"{p['modes'][d]['bytes_per_token_by_level'][outer]:.1f}" for d in DEDUP_MODES)
            print(f"  layer {li} {name + (' (run)' if name == own else ''):<18} {cells}")
    if own is None:
        print(f"  (the run's placement {report['run_placement']} is not shown: it does not place its experts on "
              f"{report['topology']})")
    rates = report["link_rates"]
    print(f"time estimates (report.md): {'default link rates' if rates['default'] else rates['source']} "
          f"({rates['levels']})")
    print(f"report: {run_dir / 'report.md'} (report.json, 4 PNG plots beside it)")
    return 0


def _place(args) -> int:
    check_output_file(args.out, "--out")
    if not 0 <= args.exact_seconds < math.inf:
        raise ValueError(f"--exact-seconds must be a finite number >= 0, got {args.exact_seconds}")
    record = RoutingRecord.load(args.stats)
    topo = topology_of(args.topology)
    if record.num_experts % topo.world_size:
        raise ValueError(f"{record.num_experts} experts do not divide over {topo.world_size} ranks")
    coactivation = record.coactivation()
    exact = bool(args.exact_seconds) and record.num_experts <= EXACT_MAX_EXPERTS
    if exact and importlib.util.find_spec("ortools") is None:
        print("exact partition skipped: OR-Tools is not installed (pip install -e '.[exact]'; make does)")
        exact = False
    # the exact placement refines each of the heuristic's splits, so it replaces Placement.optimized
    optimized = (_exact_place(coactivation, topo, args.exact_seconds) if exact
                 else Placement.optimized(coactivation, topo))
    contiguous = Placement.contiguous(record.num_experts, topo.world_size)
    src = record.expert_idx.new_tensor(range(record.expert_idx.shape[0])) % topo.world_size
    outer = topo.levels[0]
    lines = []  # all measured before the file is written: a failure leaves no placement behind
    for dedup in DEDUP_MODES:
        before, after = (dispatch_traffic(record.expert_idx, src, p, topo, record.token_bytes, dedup)
                         .by_level()[outer] / len(src) for p in (contiguous, optimized))
        saving = 1 - after / before if before else 0.0
        lines.append(f"  dedup={dedup:<5} contiguous {before:8.1f}  optimized {after:8.1f}  "
                     f"({100 * saving:+.1f}% saved)")
    optimized.to_yaml(args.out)
    print(f"wrote {args.out}; bytes per token crossing {outer} on {topo.describe()}:", *lines, sep="\n")
    return 0


def _exact_place(coactivation, topo, seconds: float) -> Placement:
    """The exact per-level partition (the heuristic's split as its start), each split's cut beside the heuristic's."""
    print(f"exact partition (CP-SAT, up to {seconds:g} s per split); co-activation weight cut:")
    placement, splits = exact_placement(coactivation, topo, seconds)
    for s in splits:
        e = s.exact
        proof = "optimal" if e.optimal else f"best found; no split cuts less than {e.lower_bound:.4g}"
        print(f"  {s.level:<5} {s.size:>3} experts into {s.parts}: heuristic {s.heuristic_cut:.4g}  exact {e.cut:.4g}"
              f"  ({proof}; {e.seconds:.1f} s)")
    return placement


def simulated_topology(args) -> Topology:
    """--topology as given; --nodes / --gpus-per-node (/ --racks) alone: those sizes on the default links;
    both: the given file's link rates at those sizes."""
    sized = [(f, v) for f, v in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node),
                                 ("--racks", args.racks)) if v is not None]
    if not args.topology and not sized:
        raise ValueError("simulate needs the cluster: --topology node=N,gpu=G (or a topology YAML), or --nodes N "
                         "--gpus-per-node G")
    if sized and (args.nodes is None or args.gpus_per_node is None):
        raise ValueError("give --nodes and --gpus-per-node together (or --topology alone)")
    for flag, value in (*sized, ("--tokens-per-rank", args.tokens_per_rank)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    given = topology_of(args.topology) if args.topology else None
    if not sized:
        return given
    levels, sizes = (("rack", "node", "gpu"), (args.racks, args.nodes, args.gpus_per_node)) if args.racks else \
        (("node", "gpu"), (args.nodes, args.gpus_per_node))
    if given is None:
        return Topology(levels, sizes)
    if given.levels != levels:
        flags = " ".join(f for f, _ in sized)
        raise ValueError(f"--topology {args.topology} has levels {list(given.levels)}, but {flags} give "
                         f"{list(levels)}: give --topology alone, or sizes for its levels")
    return Topology(levels, sizes, given.cost)


def _simulate(args) -> int:
    start = time.time()
    topo = simulated_topology(args)
    record = RoutingRecord.load(args.stats)
    out = simulate(record, topo, args.placement, args.tokens_per_rank, subtree_limit=_limit(args.subtree_limit))
    default = topo.cost == CostModel.default(topo.levels)
    out["link_rates"] = {"source": "the cost model's defaults" if default else rates_origin(args.topology),
                         "default": default, "levels": link_rates(topo)}
    out["seconds_to_simulate"] = round(time.time() - start, 2)
    if args.json:
        print(json.dumps(out, indent=1, allow_nan=False))  # strict JSON: the link bounds keep every time finite
        return 0
    print(f"{topo.describe()} ({out['world_size']} ranks), {out['experts_simulated']} experts "
          f"({out['replicas']} x {record.num_experts} recorded), {out['tokens']} tokens, {args.placement} placement:")
    for key, title in (("modes", "unlimited (recorded probabilities)" if "limited" in out else None),
                       ("limited", f"subtree limit {args.subtree_limit} (depth, M inside a block: "
                                   f"{out.get('subtree_levels')})")):
        if key not in out:
            continue
        if title:
            print(f" {title}:")
        for dedup, m in out[key].items():
            levels = ", ".join(f"{k} {v:.1f}" for k, v in m["bytes_per_token_by_level"].items())
            print(f"  dedup={dedup:<5} B/token: {levels}; est. all-to-all {1e3 * m['estimated_seconds']:.3f} ms")
    rates = out["link_rates"]
    print(f"est. all-to-all: one dispatch exchange on {'default link rates' if rates['default'] else rates['source']}"
          f" ({rates['levels']})")
    print(f"simulated in {out['seconds_to_simulate']} s")
    return 0
