"""The payload bytes of the training steps, and only theirs.

dist-moe's dispatchers count every forward's bytes; evaluation, routing records and checkpoints
run forwards too. The trainer clears the count when a step starts and takes it when the step
ends, so what is logged (``bytes_<level>``, summed over ranks since the last log) and what the run
keeps (``train_traffic.json``: each MoE layer's [W, W] bytes summed over its steps, which the
throughput experiments' step model prices) is what the steps' own routing sent. With expert-parallel
groups smaller than the world, W is a group's ranks (summed over its replicas), and the sums of the
experts' gradients over their replica groups are logged beside them (``grad_bytes_<level>``: each
rank's share of a ring all-reduce, ``placement.ep_groups.ring_sends``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dist_moe.moe.view import bytes_counter, moe_layers
from placement import Topology, Traffic, write_atomic

TRAFFIC_FILE = "train_traffic.json"


class StepBytes:
    def __init__(self, model, rt, stepper=None):
        # the layers dist-moe's dispatcher runs; an expert-parallel group of one rank exchanges nothing. Each
        # matrix is over the ranks of an EP group, as that group numbers them, summed over its replicas
        counters = [bytes_counter(m) for m in moe_layers(model)] if rt.ep_size > 1 else []
        self.layers = [c for c in counters if c is not None]
        self.rt, w = rt, rt.ep_size
        self.unlogged = torch.zeros(len(self.layers), w, w, dtype=torch.long)  # this rank's rows
        self.run = torch.zeros(len(self.layers), w, w, dtype=torch.long)  # logged, summed over ranks
        # the experts' gradient sums over their replicas (dist-moe's stepper; none without replicas)
        self.stepper = stepper if rt.experts is not None and hasattr(stepper, "grad_sent") else None
        self.levels = rt.topology().levels
        self.grad_unlogged = torch.zeros(len(self.levels), dtype=torch.long)
        self.grad_run = torch.zeros(len(self.levels), dtype=torch.long)
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
        if self.stepper is not None:
            for i, level in enumerate(self.levels):
                self.grad_unlogged[i] += self.stepper.grad_sent.pop(level, 0)
        self.steps += 1

    def pending(self) -> torch.Tensor:
        """This rank's bytes since the last log, int64 on the host: [layers, w, w] of the exchanges, then
        [levels] of the gradient sums. The trainer sums them over ranks in its one log-step reduction and
        hands the sum to ``logged``."""
        return torch.cat([self.unlogged.reshape(-1), self.grad_unlogged])

    def logged(self, total: torch.Tensor) -> dict:
        """``bytes_<level>`` over all MoE layers since the last log (``total``: ``pending`` summed over
        ranks), ``layer<i>_bytes_<level>`` each when there are several, and ``grad_bytes_<level>``."""
        exchanges, grads = total[:self.unlogged.numel()].reshape(self.unlogged.shape), total[self.unlogged.numel():]
        self.unlogged.zero_()
        self.grad_unlogged.zero_()
        out = {}
        if self.stepper is not None:
            self.grad_run += grads
            out.update({f"grad_bytes_{n}": int(b) for n, b in zip(self.levels, grads)})
        if not self.layers:
            return out
        self.run += exchanges
        per_layer = [Traffic(m, layer.topology).by_level() for m, layer in zip(exchanges, self.layers)]
        names = list(per_layer[0])
        out.update({f"bytes_{n}": sum(lv[n] for lv in per_layer) for n in names})
        if len(self.layers) > 1:
            out.update({f"layer{i}_bytes_{n}": lv[n] for i, lv in enumerate(per_layer) for n in names})
        return out

    def save(self, out_dir: Path) -> None:
        """``train_traffic.json`` (rank 0, after the last log): steps and each layer's summed matrix."""
        if not self.layers or not self.steps:
            return
        body = {"steps": self.steps, "topology": self.layers[0].topology.describe(),
                "dedup": self.layers[0].dedup, "layers": [m.tolist() for m in self.run]}
        if self.stepper is not None:  # the experts' gradient sums over their replicas, on the launch's topology
            body["grad_bytes"] = dict(zip(self.levels, self.grad_run.tolist()))
        write_atomic(Path(out_dir) / TRAFFIC_FILE, json.dumps(body) + "\n")


def per_step_traffic(run_dir: Path, topology: Topology) -> list[Traffic] | None:
    """Each MoE layer's mean bytes per training step (summed over ranks) from ``train_traffic.json``,
    or None for a run without one (one process, or from before it was written)."""
    path = Path(run_dir) / TRAFFIC_FILE
    if not path.is_file():
        return None
    body = json.loads(path.read_text())
    return [Traffic(torch.tensor(m, dtype=torch.float64) / body["steps"], topology) for m in body["layers"]]
