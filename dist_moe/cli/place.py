"""`dist-moe place`: an expert placement optimized from a run's co-activation."""
from __future__ import annotations

import importlib.util
import math

from dist_moe.cli.topology_arg import topology_of
from placement import Placement, check_output_file
from placement.exact import EXACT_MAX_EXPERTS, exact_placement
from placement.simulate import RoutingRecord
from placement.traffic import DEDUP_MODES, dispatch_traffic


def add_parser(sub, debug) -> None:
    pl = sub.add_parser("place", parents=[debug], help="an expert placement optimized from a run's co-activation")
    pl.add_argument("--topology", required=True, help="node=2,gpu=4 or a topology YAML")
    pl.add_argument("--stats", required=True, help="a run directory (its routing.npz)")
    pl.add_argument("--out", default="placement.yaml",
                    help="the placement file to write, for parallel.placement=FILE (default: %(default)s)")
    pl.add_argument("--exact-seconds", type=float, default=5.0,
                    help="time limit of each level's exact partition (CP-SAT, up to 64 experts); 0: heuristic only "
                         "(default: %(default)s)")


def run(args) -> int:
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
