"""`dist-moe calibrate`: fit the cost model to the launched cluster's links, as a topology YAML."""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from dist_moe.config.choices import MAX_TIMEOUT_S, MIN_TIMEOUT_S
from dist_moe.distributed.process_group import init_from_env, launched_world_size, resolve_device, shutdown
from placement import Topology, check_output_file
from placement.calibrate import Calibration, calibration, to_yaml
from placement.files import write_atomic


def add_parser(sub, debug) -> None:
    cp = sub.add_parser("calibrate", parents=[debug],
                        help="fit link costs with all-to-all sweeps on the launched ranks; writes a topology YAML")
    cp.add_argument("--topology", help="node=2,gpu=4 (default: from the launcher, as training reads it)")
    cp.add_argument("--out", default="calibrated_topology.yaml",
                    help="where rank 0 writes the topology YAML (default: %(default)s)")
    cp.add_argument("--repeats", type=int, default=5,
                    help="timed repeats per exchange, the median of the slowest rank kept; the one-byte exchange "
                         "that gives the collective latency 8 times as many (default: %(default)s)")
    cp.add_argument("--timeout-s", type=float, default=300.0,
                    help=f"seconds a collective may wait for a peer, {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S} (a week) "
                         "(default: %(default)s)")


def run(args) -> int:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if not MIN_TIMEOUT_S <= args.timeout_s <= MAX_TIMEOUT_S:  # training's parallel.timeout_s takes the same
        raise ValueError(f"--timeout-s must be a number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S}] (a week), "
                         f"got {args.timeout_s}")
    if os.environ.get("RANK", "0") == "0":  # rank 0 writes the file, after every rank has measured
        check_output_file(args.out, "--out")
    world = launched_world_size()
    if world < 2:
        raise ValueError("dist-moe calibrate measures exchanges between ranks: start it under a launcher, e.g. "
                         "launch/emulate_cluster.sh --nodes 2 --procs-per-node 2 $(which dist-moe) calibrate")
    topo = Topology.parse(args.topology) if args.topology else Topology.launched(world)
    if topo.world_size != world:
        raise ValueError(f"--topology {topo.describe()} has {topo.world_size} ranks, the launch {world}")
    rank, _, _ = init_from_env(args.timeout_s, device=resolve_device("auto"))
    try:
        fitted = calibration(topo, repeats=args.repeats)
    finally:
        shutdown()
    if rank == 0:
        out = Path(args.out)
        write_atomic(out, yaml.safe_dump(to_yaml(topo, fitted.cost), sort_keys=False))
        print("\n".join(summary(topo, fitted)))
        print(f"wrote {out} (dist-moe plan / simulate / report --topology {out})")
    return 0


def summary(topo: Topology, fitted: Calibration) -> list[str]:
    """What was fitted, a line for the exchange and one per level."""
    cost, latency = fitted.cost, fitted.latency
    lines = [f"{topo.describe()}: collective latency {_us(latency.median)} us (the middle half of its "
             f"{latency.repeats} repeats {_us(latency.low)}-{_us(latency.high)} us), pipelined overlap "
             f"{cost.overlap:.2f}, chunks in flight {cost.chunked:.2f}x the time of one exchange"]
    for size, (name, c) in zip(topo.sizes, cost.levels.items()):
        per = f"per {name} (shared by its ranks)" if c.shared else "per rank"
        lines.append(f"  {name:>6}: alpha {1e6 * c.alpha_s:8.1f} us per peer, {c.bandwidth_Bps / 1e6:10.1f} MB/s "
                     f"{per}{_level_note(size, c.alpha_s)}")
    return lines


def _level_note(size: int, alpha_s: float) -> str:
    if size == 1:
        return " (the default: no exchange crosses this level here)"
    if alpha_s == 0.0:  # least squares gave a negative intercept, bounded at 0
        return " (alpha clipped at 0: no cost per peer showed beyond the collective latency)"
    return ""


def _us(seconds: float) -> str:
    return f"{1e6 * seconds:,.0f}"
