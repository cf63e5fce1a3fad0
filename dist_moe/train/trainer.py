"""The trainer behind ``dist-moe train``: tabular, image or LM models, any engine, any world.

Writes ``metrics.jsonl`` (one line per logged step and per evaluation),
``config.yaml`` and ``summary.json`` to the output directory; shows tqdm
progress. With ``train.gar`` set the run trains with GAR (Algorithm 1) using
example groups of ``train.gar_group_size`` as observation units; its matched
baseline is the same config with ``train.gar.lambda: 0`` (same grouped forwards and
gradient accumulation, no auxiliary gradient).

With ``data.categories`` every row carries its category into the model: SpecDrop
routes by it, ``model.label_mask`` masks logits outside it, and evaluation adds
SpecDrop's Align (category c's assigned expert is c mod E).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from dist_moe.dispatch.agree import agree_on_errors
from dist_moe.dispatch.process_group import collective_failure
from dist_moe.gar.config import GARConfig
from dist_moe.gar.step import equal_task_weights, gar_train_step
from dist_moe.moe_view import moe_layers
from dist_moe.train import checkpoint, records
from dist_moe.train.build import data_and_model
from dist_moe.train.config import model_changes, validate
from dist_moe.train.evaluate import evaluate, loss_of
from dist_moe.train.metrics import layer_metrics, layers_metrics
from dist_moe.train.rundir import RunLock, check_writable, truncate_metrics
from dist_moe.train.runtime import Runtime
from placement import random_pair_tree_distance

def json_safe(record: dict) -> dict:
    """NaN / inf (e.g. tree distance with top-1 routing) become null: strict JSON has no NaN."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


class JsonlLogger:
    """metrics.jsonl, and with ``tensorboard`` the same numbers as TensorBoard scalars (under the
    record's step, in ``<run>/tensorboard``; needs the optional ``tensorboard`` package)."""

    def __init__(self, path: Path, append: bool = False, tensorboard: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # torch's writer imports the tensorboard package
                raise ValueError(f"output.tensorboard needs the tensorboard package (pip install tensorboard): {e}")
            self._tb = SummaryWriter(str(path.parent / "tensorboard"))
        self._f = path.open("a" if append else "w")

    def log(self, record: dict) -> None:
        self._f.write(json.dumps(json_safe(record)) + "\n")
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


def train(cfg: dict, quiet: bool = False, after=None) -> dict:
    """Train ``cfg["model"]["kind"]`` with ``cfg["engine"]`` over the launched world (one process: local).

    ``after(model, data, runtime) -> dict``, when given, runs on every rank once training ends
    (it may use collectives) and its fields join the summary: experiments measure the trained
    model this way without the trainer knowing their metrics.
    """
    validate(cfg)
    runtime = Runtime(cfg["engine"], cfg["parallel"])
    failed = True
    try:
        summary = _train(cfg, runtime, quiet, after)
        failed = False
        return summary
    except Exception as e:
        clear = collective_failure(e, runtime.rank, runtime.world, runtime.timeout_s) if runtime.world > 1 else None
        if clear is not None:
            raise clear from e
        raise
    finally:
        runtime.shutdown(failed=failed)


def _open_run(cfg: dict, rt: Runtime):
    """Every rank's start-up checks, agreed before any training collective: the output directory is
    writable, no other run holds it (rank 0 takes its lock), and a resumed checkpoint fits this config.
    Returns (output directory, the lock or None, the checkpoint to resume or None)."""
    out_dir = Path(cfg["output"]["dir"].format(name=cfg["name"]))
    lock = RunLock(out_dir) if rt.is_main else None
    found = []

    def check():
        check_writable(out_dir)
        if lock is not None:
            lock.acquire()
        path = checkpoint.latest(out_dir / "checkpoints") if cfg["train"]["resume"] else None
        if path is not None:
            saved = checkpoint.saved_config(path)
            for key, old, new in model_changes(saved, cfg)[:1] if saved is not None else ():
                raise ValueError(f"train.resume: config key {key!r} is {new!r} in this run but {old!r} in "
                                 f"checkpoint {path}: resuming would mix two models; use the checkpoint's "
                                 "value, or train into a new output.dir")
        found.append(path)

    try:
        agree_on_errors(check, rt.group if rt.world > 1 else None)
    except ValueError:
        if lock is not None:
            lock.release()
        raise
    return out_dir, lock, found[0]


def _train(cfg: dict, rt: Runtime, quiet: bool, after=None) -> dict:
    out_dir, lock, resume_from = _open_run(cfg, rt)
    try:
        return _train_in(cfg, rt, quiet, after, out_dir, resume_from)
    finally:
        if lock is not None:
            lock.release()


def _train_in(cfg: dict, rt: Runtime, quiet: bool, after, out_dir: Path, resume_from) -> dict:
    tcfg = cfg["train"]
    torch.manual_seed(cfg["seed"])  # the same on every rank: replicated modules start identical
    data, model = data_and_model(cfg, rt)
    model.to(rt.device)  # every batch follows it there (data stays on the CPU until its step)
    layers = moe_layers(model)  # every MoE layer: metrics and schedules cover them all
    routers = [layer.router for layer in layers]
    gar = None if tcfg["gar"] is None else GARConfig.from_dict(tcfg["gar"])
    bs = tcfg["batch_size"]  # per rank, as DeepSpeed's train_micro_batch_size_per_gpu
    step_fn = rt.stepper(model, tcfg["lr"], tcfg["max_grad_norm"], bs)
    ckpt_dir = out_dir / "checkpoints"

    n, global_bs = len(data.x_train), bs * rt.world
    steps_per_epoch = math.ceil(n / global_bs)
    max_steps = tcfg["max_steps"]
    total_samples = tcfg["epochs"] * n  # the run's length in samples, unless max_steps sets it in steps
    cursor = records.DataCursor(n, cfg["seed"], global_bs)  # the same order on every rank; each takes its share
    step, start, last_eval = 0, time.time(), {}
    train_seconds = 0.0  # inside training steps only: no evaluation, logging or checkpoints
    skipped = 0  # steps skipped for a non-finite loss or gradients
    if resume_from is not None:
        step = records.resume(resume_from, model, step_fn.opt, cursor, rt)
    resumed_at = cursor.consumed
    if rt.is_main:
        (out_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        if resume_from is not None:  # rows a killed run logged after this checkpoint are trained again
            truncate_metrics(out_dir / "metrics.jsonl", step)
    logger = (JsonlLogger(out_dir / "metrics.jsonl", resume_from is not None, cfg["output"]["tensorboard"])
              if rt.is_main else None)
    total = max_steps or step + cursor.steps_left(total_samples)
    epochs = math.ceil(max_steps / steps_per_epoch) if max_steps else tcfg["epochs"]

    def finished() -> bool:
        return step >= max_steps if max_steps else cursor.consumed >= total_samples

    def progress() -> float:  # step / total, bit for bit, for an uninterrupted run; samples when the world changed
        if max_steps:
            return step / max_steps
        return (cursor.epoch * steps_per_epoch + cursor.offset / global_bs) / (epochs * steps_per_epoch)

    # Redrawn 10x a second on a terminal; in a log file (CI, nohup) every 10 s is enough.
    bar = tqdm(total=total, initial=step, desc=cfg["name"], disable=quiet or not rt.is_main, dynamic_ncols=True,
               mininterval=0.1 if sys.stderr.isatty() else 10.0)
    try:
        already_finished = resume_from is not None and finished()
        if already_finished:  # nothing left to train: report the checkpoint's model as it is
            last_eval = evaluate(model, data.x_val, data.y_val, data.val_categories(), runtime=rt)
        scheduled = [r for r in routers if r.scheduled]  # SpecDrop's schedule, unless it counts its own steps
        while not finished():
            if tcfg["schedule"] == "epoch":
                for r in scheduled:
                    r.set_progress(cursor.epoch / epochs)
            while True:  # the steps of this epoch (from mid-epoch after a resume)
                if tcfg["schedule"] == "step":
                    for r in scheduled:
                        r.set_progress(progress())
                step_start = time.perf_counter()
                rows = torch.tensor_split(cursor.next_batch(), rt.world)[rt.rank]
                xb, yb = data.x_train[rows].to(rt.device), data.y_train[rows].to(rt.device)
                cb = data.train_categories(rows)
                cb = None if cb is None else cb.to(rt.device)
                if _bad_inputs(xb, rt):  # agreed before any forward: no rank enters a collective alone
                    record = {"loss": math.nan, "skipped": 1.0}
                else:
                    record = (_gar_step(model, step_fn, xb, yb, cb, gar, tcfg, rt) if gar
                              else _plain_step(model, step_fn, xb, yb, cb))
                record = _mean_over_ranks(record, rt)
                train_seconds += time.perf_counter() - step_start
                step += 1
                skipped += record.get("skipped", 0.0) > 0  # agreed by every rank
                if skipped > tcfg["max_skipped_steps"] or (gar and not math.isfinite(record["loss"])):
                    raise ValueError(f"training diverged: {int(skipped)} steps had a non-finite loss or gradients "
                                     f"(train.max_skipped_steps={tcfg['max_skipped_steps']}), the last at step {step} "
                                     f"(loss {record['loss']}); lower train.lr (now {tcfg['lr']}) or check the data")
                last = finished()
                if step % tcfg["log_every"] == 0 or last:
                    record.update(records.measured_bytes(model, rt))  # collective: every rank takes part
                if logger is not None and (step % tcfg["log_every"] == 0 or last):
                    if all(layer.last_routing is not None for layer in layers):  # None: every step skipped
                        record.update(layers_metrics([layer_metrics(layer) for layer in layers]))
                    if hasattr(routers[0], "progress"):
                        record["schedule_progress"] = float(routers[0].progress)
                    logger.log({"step": step, **record})
                    bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
                bar.update(1)
                if tcfg["checkpoint_every"] and (step % tcfg["checkpoint_every"] == 0 or last):
                    checkpoint.save(ckpt_dir, step, model, step_fn.opt, records.position(step, cursor, rt),
                                    rt.group if rt.world > 1 else None, config=cfg)
                if last or cursor.offset == 0:
                    break
            last_eval = evaluate(model, data.x_val, data.y_val, data.val_categories(), runtime=rt)
            records.measured_bytes(model, rt)  # drop the evaluation's bytes: the logged ones are training bytes
            if logger is not None:
                logger.log({"step": step, "epoch": math.ceil(cursor.consumed / n), **last_eval})
        records.record_routing(out_dir, model, data, rt)
        extra = after(model, data, rt) if after is not None else {}
    finally:
        bar.close()
        if logger is not None:
            logger.close()
    summary = {
        "name": cfg["name"], "router": cfg["router"]["type"], "engine": rt.engine.name, "world_size": rt.world,
        "topology": rt.topology().describe(),
        "steps": step, "already_finished": already_finished, "samples": cursor.consumed,
        "samples_this_run": cursor.consumed - resumed_at,
        "skipped_steps": int(skipped), "seconds": round(time.time() - start, 2),
        "train_seconds": round(train_seconds, 3),
        **last_eval,
        "random_pair_tree_distance": _random_pair(layers[0].num_experts), "output_dir": str(out_dir), **extra,
    }
    summary = json_safe(summary)
    if rt.is_main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _mean_over_ranks(record: dict, rt: Runtime) -> dict:
    """Logged losses are the mean over ranks (each rank's is its own micro-batch's)."""
    if rt.world == 1:
        return record
    keys = sorted(record)
    values = rt.sum(torch.tensor([float(record[k]) for k in keys], dtype=torch.float64)) / rt.world
    return dict(zip(keys, values.tolist()))


def _random_pair(num_experts: int) -> float:
    return random_pair_tree_distance(num_experts) if num_experts >= 2 and not num_experts & (num_experts - 1) else None


def _bad_inputs(xb: torch.Tensor, rt: Runtime) -> bool:
    """Whether any rank's batch holds NaN or Inf (token ids never do)."""
    if not xb.is_floating_point():
        return False
    return float(rt.sum(torch.tensor([float(not bool(torch.isfinite(xb).all()))]))) > 0


def _plain_step(model, step_fn, xb, yb, cb) -> dict:
    """One step. When the loss or gradients are not finite on any rank, every rank skips the
    update and restores the buffers the forward moved (BRANCH anchors and EMA step, DeepSeek-V3
    biases, load counters), so the bad batch leaves no trace but its count."""
    saved = [b.detach().clone() for b in model.buffers()]
    logits, aux = step_fn.module(xb, cb)
    # a rank left without rows (the epoch's last, short batch) still runs the step's collectives
    task = loss_of(logits, yb) if yb.numel() else logits.sum() * 0.0
    stepped = step_fn(task + aux)
    if not stepped:
        with torch.no_grad():
            for b, old in zip(model.buffers(), saved):
                b.copy_(old)
    return {"loss": float(task.detach()), "aux_loss": float(aux.detach()), "skipped": 0.0 if stepped else 1.0}


def _gar_step(model, step_fn, xb, yb, cb, gar, tcfg, rt: Runtime) -> dict:
    g = tcfg["gar_group_size"]
    same_category = tcfg["gar_groups"] == "same_category"
    if same_category and (cb is None or rt.world > 1):
        raise ValueError("train.gar_groups=same_category needs categories (e.g. text tasks) and one process")
    if same_category:  # the paper's same-task groups: up to g rows of one category each
        parts = [rows[i : i + g] for c in cb.unique().tolist()
                 for rows in [(cb == c).nonzero().squeeze(1)] for i in range(0, len(rows), g)]
    elif rt.world == 1:  # consecutive groups of g rows
        parts = [torch.arange(i, min(i + g, len(xb))) for i in range(0, len(xb), g)]
    else:  # every rank takes the same number of groups: the m-th of every rank form unit m
        count = max(1, math.ceil(tcfg["batch_size"] / g))
        parts = list(torch.tensor_split(torch.arange(len(xb)), count))
        if any(len(rows) == 0 for rows in parts):
            raise ValueError(f"a rank holds {len(xb)} rows for {count} GAR groups: raise train.batch_size")
    groups = [(xb[r], yb[r], None if cb is None else cb[r]) for r in parts]

    def loss_fn(m, group):
        logits, aux = m(group[0], group[2])
        return loss_of(logits, group[1]) + aux

    if same_category:  # tasks weigh equally, examples equally within a task
        weights = equal_task_weights([int(grp[2][0]) for grp in groups], [len(grp[0]) for grp in groups])
    elif rt.world == 1:
        weights = [len(grp[0]) / len(xb) for grp in groups]
    else:
        weights = [1 / len(groups)] * len(groups)
    sizes = [len(grp[0]) for grp in groups] if rt.world > 1 else None
    # DeepSpeed owns reduction, clip and step: GAR hands it the accumulated gradients
    finish = getattr(step_fn, "finish_external", None)
    out = gar_train_step(model, groups, loss_fn, step_fn.opt, weights, gar.lam, gar.eps, tcfg["max_grad_norm"],
                         gar.mode, sizes=sizes, unit=gar.unit, finish=finish)
    return {"loss": out["task_loss"], "gar_loss": out["gar_loss"]}
