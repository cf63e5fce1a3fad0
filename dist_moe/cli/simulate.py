"""`dist-moe simulate`: replay a run's routing on a simulated cluster."""
from __future__ import annotations

import json
import time

from dist_moe.cli.topology_arg import rates_origin, topology_of
from placement import Topology
from placement.cost import CostModel
from placement.placement import NAMED as PLACEMENTS
from placement.report import link_rates
from placement.simulate import RoutingRecord, simulate


def add_parser(sub, debug) -> None:
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


def run(args) -> int:
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
