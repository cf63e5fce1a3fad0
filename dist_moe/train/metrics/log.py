"""metrics.jsonl: each logged record as strict JSON (and TensorBoard scalars), its values reduced over the
ranks in one all-reduce per log step, and the time training waited in exchanges."""
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch

from dist_moe.dispatch.all_to_all import blocked_seconds
from dist_moe.distributed.device_choice import to_device
from dist_moe.train.rundir import open_metrics


def json_safe(value):
    """NaN / inf (e.g. tree distance with top-1 routing) become null, at any depth (an experiment's
    measures in the summary): strict JSON has no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class JsonlLogger:
    """metrics.jsonl, and with ``tensorboard`` the same numbers as TensorBoard scalars (under the
    record's step, in ``<run>/tensorboard``; needs the optional ``tensorboard`` package)."""

    def __init__(self, path: Path, append: bool = False, tensorboard: bool = False):
        self._tb = None
        if tensorboard:
            try:
                # tensorboard: optional, only with output.tensorboard
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # torch's writer imports the tensorboard package
                raise ValueError(f"output.tensorboard needs the tensorboard package: .venv/bin/pip install -e "
                                 f"'.[tensorboard]' ({e})") from None
            self._tb = SummaryWriter(str(path.parent / "tensorboard"))
        self._f = open_metrics(path, append)

    def log(self, record: dict) -> None:
        self._f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self._f.flush()
        if self._tb is not None:
            prefix = "val/" if any(k.startswith("val_") for k in record) else "train/"
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(prefix + key, value, record["step"])

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


class TrainingWaits:
    """This run's time waiting in exchanges during training steps: ``blocked_seconds`` since the run
    started, less what evaluation waited (``outside``)."""

    def __init__(self):
        self.start, self.elsewhere = blocked_seconds(), 0.0

    @contextlib.contextmanager
    def outside(self):
        before = blocked_seconds()  # settles the steps' waits first: they stay training's
        try:
            yield
        finally:
            self.elsewhere += blocked_seconds() - before

    def read(self, settled: bool) -> float:
        return blocked_seconds(settled) - self.start - self.elsewhere


def reduced(record: dict, sums: torch.Tensor, rt, copy=()) -> tuple[dict, torch.Tensor, list]:
    """(the record's values averaged over ranks, ``sums`` [host int64] summed over them, host copies of
    ``copy``'s device tensors): one all-reduce and one read for all three. The record holds device
    scalars and host floats (times); the host values go up through pinned memory, which does not wait
    for the device. Integer tensors travel as float64: exact below 2**53."""
    keys = sorted(record)
    on_device = [k for k in keys if torch.is_tensor(record[k])]
    on_host = [k for k in keys if not torch.is_tensor(record[k])]
    host = torch.cat([torch.tensor([float(record[k]) for k in on_host], dtype=torch.float64),
                      sums.reshape(-1).double()])
    parts = [to_device(host, rt.device)]
    if on_device:
        parts.insert(0, torch.stack([record[k].to(rt.device, torch.float64).reshape(()) for k in on_device]))
    values = torch.cat(parts)
    values = rt.sum(values) if rt.world > 1 else values
    read = torch.cat([values, *(t.detach().to(rt.device, torch.float64).reshape(-1) for t in copy)]).tolist()
    n, m = len(keys), values.numel()
    means = {k: v / rt.world for k, v in zip(on_device + on_host, read[:n])}
    summed = torch.tensor(read[n:m], dtype=torch.float64).round().long().reshape(sums.shape)
    copies, start = [], m
    for t in copy:
        copies.append(torch.tensor(read[start:start + t.numel()], dtype=torch.float64).to(t.dtype).reshape(t.shape))
        start += t.numel()
    return means, summed, copies
