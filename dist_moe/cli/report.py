"""`dist-moe report`: report.json, report.md and PNG plots of a run's communication cost."""
from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

from dist_moe.cli.topology_arg import CALIBRATION, rates_origin, topology_of
from dist_moe.train.rundir import LOCK, METRICS
from placement import Topology, read_yaml
from placement.report import against_flat_sentence, write_report
from placement.simulate import ROUTING_FILE, RoutingRecord
from placement.traffic import DEDUP_MODES


def add_parser(sub, debug) -> None:
    rp = sub.add_parser("report", parents=[debug],
                        help="report.json, report.md and PNG plots of a run's communication cost")
    rp.add_argument("run_dir", help="a run directory written by dist-moe train (its routing.npz and config.yaml); "
                                    "the report files are written into it")
    rp.add_argument("--topology", help="node=2,gpu=4 or a topology YAML such as dist-moe calibrate's, whose link "
                                       "rates then price the exchanges (default: the topology the run recorded, "
                                       f"else the run directory's {CALIBRATION}, else an assumed 2 nodes x 2 GPUs, "
                                       "which the report says)")


def run(args) -> int:
    run_dir = Path(args.run_dir)
    training = still_training(run_dir)  # before the files are read: then they may be a live run's
    if training and not (run_dir / ROUTING_FILE).exists():
        raise ValueError(f"the run in {run_dir} is still training and writes its routing record ({ROUTING_FILE}) "
                         "when it ends: run dist-moe report then")
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
    against = against_flat_sentence(report)
    if against:
        print(against)
    rates = report["link_rates"]
    print(f"time estimates (report.md): {'default link rates' if rates['default'] else rates['source']} "
          f"({rates['levels']})")
    print(f"report: {run_dir / 'report.md'} (report.json, 4 PNG plots beside it)")
    return 0


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
