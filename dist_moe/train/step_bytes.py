"""The payload bytes of the training steps, and only theirs.

dist-moe's dispatchers count every forward's bytes; evaluation, routing records and checkpoints
run forwards too. The trainer clears the count when a step starts and takes it when the step
ends, so what is logged (``bytes_<level>``, summed over ranks since the last log) and what the run
keeps (``train_traffic.json``: each MoE layer's [W, W] bytes summed over its steps, which the
throughput experiments' step model prices) is what the steps' own routing sent.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dist_moe.dispatch.contract import CountsBytes
from dist_moe.moe.view import moe_layers
from placement import Topology, Traffic, write_atomic

TRAFFIC_FILE = "train_traffic.json"


class StepBytes:
    def __init__(self, model, rt):
        # the layers dist-moe's dispatcher runs; an expert-parallel group of one rank exchanges nothing. Each
        # matrix is over the ranks of an EP group, as that group numbers them, summed over its replicas
        self.layers = [m for m in moe_layers(model) if isinstance(m, CountsBytes)] if rt.ep_size > 1 else []
        self.rt, w = rt, rt.ep_size
        self.unlogged = torch.zeros(len(self.layers), w, w, dtype=torch.long)  # this rank's rows
        self.run = torch.zeros(len(self.layers), w, w, dtype=torch.long)  # logged, summed over ranks
        self.steps = 0

    def clear(self) -> None:
        """Forget what forwards outside a training step sent (evaluation, records)."""
        for layer in self.layers:
            layer.reset_traffic()

    def take(self) -> None:
        """After a training step: add its bytes (host counts, no collective)."""
        for i, layer in enumerate(self.layers):
            self.unlogged[i] += layer.traffic.matrix
            layer.reset_traffic()
        self.steps += 1

    def pending(self) -> torch.Tensor:
        """This rank's bytes since the last log, [layers, w, w] int64 on the host: the trainer sums them
        over ranks in its one log-step reduction and hands the sum to ``logged``."""
        return self.unlogged

    def logged(self, total: torch.Tensor) -> dict:
        """``bytes_<level>`` over all MoE layers since the last log (``total``: ``pending`` summed over
        ranks), and ``layer<i>_bytes_<level>`` each when there are several."""
        if not self.layers:
            return {}
        self.unlogged.zero_()
        self.run += total
        per_layer = [Traffic(m, layer.topology).by_level() for m, layer in zip(total, self.layers)]
        names = list(per_layer[0])
        out = {f"bytes_{n}": sum(lv[n] for lv in per_layer) for n in names}
        if len(self.layers) > 1:
            out.update({f"layer{i}_bytes_{n}": lv[n] for i, lv in enumerate(per_layer) for n in names})
        return out

    def save(self, out_dir: Path) -> None:
        """``train_traffic.json`` (rank 0, after the last log): steps and each layer's summed matrix."""
        if not self.layers or not self.steps:
            return
        body = {"steps": self.steps, "topology": self.layers[0].topology.describe(),
                "dedup": self.layers[0].dedup, "layers": [m.tolist() for m in self.run]}
        write_atomic(Path(out_dir) / TRAFFIC_FILE, json.dumps(body) + "\n")


def per_step_traffic(run_dir: Path, topology: Topology) -> list[Traffic] | None:
    """Each MoE layer's mean bytes per training step (summed over ranks) from ``train_traffic.json``,
    or None for a run without one (one process, or from before it was written)."""
    path = Path(run_dir) / TRAFFIC_FILE
    if not path.is_file():
        return None
    body = json.loads(path.read_text())
    return [Traffic(torch.tensor(m, dtype=torch.float64) / body["steps"], topology) for m in body["layers"]]
