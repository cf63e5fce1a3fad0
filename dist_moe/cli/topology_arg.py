"""The ``--topology`` argument of report, place, simulate and plan: a spec (node=2,gpu=4) or a topology YAML
such as ``dist-moe calibrate`` writes, whose link rates then price the exchanges."""
from __future__ import annotations

from pathlib import Path

from placement import Topology, read_yaml
from placement.simulate import RoutingRecord

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


def rates_origin(path: str | Path) -> str:
    """How a topology YAML's link rates were had: calibrate stamps its fits."""
    stamp = (read_yaml(path, "topology").get("exchange") or {}).get("calibrated")
    return f"calibrated {stamp} ({path})" if stamp else str(path)
