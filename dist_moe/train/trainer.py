"""The trainer behind ``dist-moe train``: tabular, image or LM models, any engine, any world.

Writes ``metrics.jsonl`` (one line per logged step and per evaluation),
``config.yaml``, ``summary.json`` and, under expert parallelism, ``train_traffic.json``
(``step_bytes``) to the output directory; shows tqdm
progress. With ``train.gar`` set the run trains with GAR (Algorithm 1) using
example groups of ``train.gar_group_size`` as observation units; its matched
baseline is the same config with ``train.gar.lambda: 0`` (same grouped forwards and
gradient accumulation, no auxiliary gradient).

With ``data.categories`` every row carries its category into the model: SpecDrop
routes by it, ``model.label_mask`` masks logits outside it, and evaluation adds
SpecDrop's Align (category c's assigned expert is c mod E).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from dist_moe.distributed.device_choice import to_device
from dist_moe.distributed.every_rank import agree_on_errors, raise_on_every_rank
from dist_moe.distributed.process_group import barrier, collective_failure, launched_world_size, resolve_device
from dist_moe.models.hf_export import settle_export
from dist_moe.moe.view import moe_layers
from dist_moe.routing.base import Scheduled
from dist_moe.train.build import data_and_model
from dist_moe.train.checkpoint import store as checkpoint
from dist_moe.train.checkpoint.state import DataCursor, restore_state, save_state
from dist_moe.train.chunk_tuning import ChunkTuner
from dist_moe.train.config import model_changes
from dist_moe.train.layout_choice import choose_layout
from dist_moe.train.metrics.evaluate import evaluate
from dist_moe.train.metrics.log import JsonlLogger, TrainingWaits, reduced
from dist_moe.train.metrics.routing import host_layer_metrics, layers_metrics, routing_tensors
from dist_moe.train.metrics.routing_record import record_routing
from dist_moe.train.metrics.step_bytes import StepBytes
from dist_moe.train.metrics.summary import Trained, write_summary
from dist_moe.train.rank_memory import available_per_rank
from dist_moe.train.run_config import RunConfig, output_dir
from dist_moe.train.rundir import RunDir, check_writable, staging_dir, truncate_metrics
from dist_moe.train.runtime import Runtime
from dist_moe.train.step.training_step import step_strategy
from dist_moe.train.step.unread_checks import FAILED, raise_failed, take_unread
from placement import Topology, write_atomic


def train(cfg: RunConfig, quiet: bool = False, after=None) -> dict:
    """Train ``cfg.model.kind`` with ``cfg.engine`` over the launched world (one process: local). ``cfg``:
    ``load_config``'s ``RunConfig`` (``RunConfig.from_dict`` for a mapping), checked once, where it was made.

    ``after(model, data, runtime) -> dict``, when given, runs on every rank once training ends
    (it may use collectives) and its fields join the summary: experiments measure the trained
    model this way without the trainer knowing their metrics.
    """
    if not isinstance(cfg, RunConfig):
        raise TypeError(f"train takes load_config's RunConfig (RunConfig.from_dict for a mapping), got "
                        f"{type(cfg).__name__}")
    if cfg.parallel.ep_size == "auto":  # every rank prices the same layouts, before any process group
        cfg = _with_planned_layout(cfg)
    runtime = Runtime(cfg.engine, cfg.parallel, cfg.train.precision, cfg.train.deterministic,
                      gar=cfg.train.gar is not None)
    # train.precision: auto as it resolved on this device: what the run saves, resumes against and reports
    cfg = replace(cfg, train=replace(cfg.train, precision=runtime.precision))
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


def _with_planned_layout(cfg: RunConfig) -> RunConfig:
    """``parallel.ep_size: auto`` resolved (``layout_choice``), said once by rank 0."""
    world = launched_world_size()
    device = resolve_device(cfg.parallel.device).type
    cfg, said = choose_layout(cfg, Topology.launched(world), available_per_rank()[0], device)
    if os.environ.get("RANK", "0") == "0":
        print(f"dist-moe: {said}", file=sys.stderr)
    return cfg


def _open_run(cfg: RunConfig, rt: Runtime, out_dir: Path, run_dir: RunDir | None, work_dir: Path):
    """The start-up checks, agreed before any training collective. First rank 0 alone (``run_dir``)
    creates the output directory, takes its lock and refuses a directory whose run files are symlinks
    or that holds a run this config neither resumes nor overwrites; then every rank checks that it
    can write where the run writes (``work_dir``: the output directory, or its staging directory under
    output.overwrite) and that a resumed checkpoint fits this config. Returns the checkpoint to resume,
    None, or ``EXPORTED`` (resuming a run without checkpoints that had trained and exported its model)."""
    found: list = []
    group = rt.group if rt.world > 1 else None

    def claim():  # rank 0 alone; the others wait for its verdict
        if run_dir is not None:
            run_dir.open(cfg.train.resume, cfg.output.overwrite)
            if cfg.train.resume and run_dir.held and checkpoint.latest(out_dir / "checkpoints") is None:
                settle_export(out_dir / HF_MODEL)  # a kill in the final export's swap: the model goes in place
                if trained_and_exported(out_dir):
                    return
                # starting afresh would replace that run's metrics and summary without a word
                why = "it stopped before its first" if cfg.train.checkpoint_every else \
                    "train.checkpoint_every is null: none are kept"
                raise ValueError(f"train.resume=true: output.dir {str(out_dir)!r} holds a run "
                                 f"({', '.join(run_dir.held)}) but no checkpoint to continue from ({why}); set "
                                 "output.overwrite=true to train it again from the start, or choose another output.dir")

    agree_on_errors(claim, group)
    checkpoint.check_shared(work_dir / "checkpoints", cfg.train, group)  # before any rank looks for one there

    def check():
        check_writable(work_dir)
        path = checkpoint.latest(out_dir / "checkpoints") if cfg.train.resume else None
        if path is None and cfg.train.resume and trained_and_exported(out_dir):
            found.append(EXPORTED)
            return
        if path is not None:
            saved = checkpoint.saved_config(path)
            for key, old, new in model_changes(saved, cfg)[:1] if saved is not None else ():
                raise ValueError(f"train.resume: config key {key!r} is {new!r} in this run but {old!r} in "
                                 f"checkpoint {path}: resuming would mix two models; use the checkpoint's "
                                 "value, or train into a new output.dir")
        found.append(path)

    agree_on_errors(check, group)
    return found[0]


EXPORTED = object()  # _open_run's answer for a run without checkpoints whose training and export are done


def trained_and_exported(out_dir: Path) -> bool:
    """Whether a run without checkpoints ended its training: its trained model is exported, and a kill came
    before the summary that closes a run (model.kind hf writes the model last but for the summary)."""
    model = out_dir / HF_MODEL
    return model.is_dir() and not model.is_symlink() and not (out_dir / "summary.json").exists()


def _train(cfg: RunConfig, rt: Runtime, quiet: bool, after=None) -> dict:
    out_dir = output_dir(cfg)
    # output.overwrite: the run it replaces stays whole, report included, until this one has finished
    work_dir = staging_dir(out_dir) if cfg.output.overwrite else out_dir
    run_dir = RunDir(out_dir) if rt.is_main else None
    run = None
    try:
        resume_from = _open_run(cfg, rt, out_dir, run_dir, work_dir)
        if resume_from is EXPORTED:  # nothing to train, nothing to resume from: say where the model is
            return {"name": cfg.name, "output_dir": str(out_dir), "hf_model": str(out_dir / HF_MODEL),
                    "exported_before": True}
        run = _TrainingRun(cfg, rt, work_dir, resume_from, quiet)
        summary = _train_in(run, after)
        if work_dir != out_dir:
            _swap_in(run_dir, rt)
        return summary
    except BaseException as e:
        newest = _newest_checkpoint(work_dir) if isinstance(e, KeyboardInterrupt) else None
        if run_dir is not None and (run is None or run.step == run.first_step):
            run_dir.discard()  # stopped before its first step: leave nothing it created behind
        elif run_dir is not None and (note := run_dir.stopped_note()) is not None:
            print(f"dist-moe: the run stopped: {note}", file=sys.stderr)
        if newest is not None and work_dir == out_dir:
            # Ctrl-C: where the run goes on from (every rank: a launcher shows one's line); an overwriting
            # run's checkpoint is not in output.dir, whose resume would continue the run it was to replace
            raise KeyboardInterrupt(f"train.resume=true continues from {newest}") from None
        raise
    finally:
        if run_dir is not None:
            run_dir.release()


def _swap_in(run_dir: RunDir | None, rt: Runtime) -> None:
    """output.overwrite's end: once every rank has written its last file, rank 0 puts the new run in the old
    one's place; every rank fails alike if that fails."""
    group = rt.group if rt.world > 1 else None
    barrier(group)
    failure = None
    if run_dir is not None:
        try:
            run_dir.finish()
        except (OSError, ValueError) as e:
            failure = e
    raise_on_every_rank(failure, group)


def _newest_checkpoint(out_dir: Path) -> Path | None:
    """The checkpoint a resumed run would start from, or None (none, or one that cannot be read)."""
    try:
        return checkpoint.latest(out_dir / "checkpoints")
    except (ValueError, OSError):
        return None


def _train_in(run: _TrainingRun, after) -> dict:
    rt, out_dir = run.rt, run.out_dir
    try:
        if run.already_finished:  # nothing left to train: report the checkpoint's model as it is
            run.last_eval = run.evaluate()
        while not run.finished():
            run.move_schedules("epoch")
            while True:  # the steps of this epoch (from mid-epoch after a resume)
                run.move_schedules("step")
                record = run.train_step()
                last = run.finished()
                run.maybe_log(record, last)
                run.maybe_checkpoint(last)
                if last or run.cursor.offset == 0:
                    break
            run.evaluate_epoch()
        run.check_trained()
        run.exchange_wait_s = run.waits.read(settled=True)  # training's, before the routing record's forwards
        record_routing(out_dir, run.model, run.data, rt, run.tcfg.eval_rows(rt.world))
        if hasattr(run.model, "export_state"):  # model.kind hf: the trained model as transformers reads it
            export_hf(run.model, out_dir / HF_MODEL, rt)
        extra = after(run.model, run.data, rt) if after is not None else {}
    finally:
        run.close()
    if rt.is_main:
        run.step_bytes.save(out_dir)
    final_dir = output_dir(run.cfg)  # where its files are once an overwriting run is swapped in
    hf_model = final_dir / HF_MODEL if hasattr(run.model, "export_state") else None
    return write_summary(run.cfg, rt, out_dir, run.trained(), run.tuner, run.layers[0], hf_model, extra)


class _TrainingRun:
    """One run's training state: model, data, cursor, stepper, step strategy, logger and progress bar."""

    def __init__(self, cfg: RunConfig, rt: Runtime, out_dir: Path, resume_from, quiet: bool):
        self.cfg, self.rt, self.out_dir, self.tcfg = cfg, rt, out_dir, cfg.train  # out_dir: where it writes
        tcfg = self.tcfg
        torch.manual_seed(cfg.seed)  # the same on every rank: replicated modules start identical
        self.data, self.model = data_and_model(cfg, rt)
        self.model.to(rt.device)  # every batch follows it there (data stays on the CPU until its step)
        self.layers = moe_layers(self.model)  # every MoE layer: metrics and schedules cover them all
        self.routers = [layer.router for layer in self.layers]
        if self.rt.device.type == "cuda":  # input checks wait on the device for the log step's read, no assert
            for router in self.routers:
                if hasattr(router, "defer_checks"):
                    router.defer_checks = True
        self.scheduled = [r for r in self.routers if r.scheduled]  # SpecDrop's, unless it counts its own steps
        self.strategy = step_strategy(tcfg, rt)  # plain or GAR, chosen once
        bs = tcfg.batch_size  # per rank, as DeepSpeed's train_micro_batch_size_per_gpu
        self.step_fn = rt.stepper(self.model, tcfg.lr, tcfg.max_grad_norm, bs)
        self.n, self.global_bs = len(self.data.x_train), bs * rt.world
        self.steps_per_epoch = math.ceil(self.n / self.global_bs)
        self.max_steps = tcfg.max_steps
        self.total_samples = tcfg.epochs * self.n  # the run's length in samples, unless max_steps sets it
        self.cursor = DataCursor(self.n, cfg.seed, self.global_bs)  # one order; each rank its share
        self.step, self.start, self.last_eval = 0, time.time(), {}
        self.train_seconds = 0.0  # inside training steps only: no evaluation, logging or checkpoints
        self.waits = TrainingWaits()  # of those, waiting in the dispatcher's exchanges
        self.exchange_wait_s = 0.0  # their total, once training ends
        self.step_bytes = StepBytes(self.model, rt, self.step_fn)  # what the training steps sent, nothing else
        # parallel.pipeline_chunks auto: measured over the first steps where a node boundary is crossed
        auto = cfg.parallel.pipeline_chunks == "auto"
        self.tuner = ChunkTuner(self.model, auto and rt.ep_size > 1 and rt.ep_topology().num_nodes > 1, rt.device,
                                rt.group if rt.world > 1 else None)
        # steps skipped for a non-finite loss or gradients: counted on the device, read when logged
        self.skipped, self.skipped_steps = torch.zeros((), device=rt.device), 0
        if resume_from is not None:
            self.step = restore_state(resume_from, self.model, self.step_fn.opt, self.cursor, rt)
        self.first_step, self.resumed_at = self.step, self.cursor.consumed
        self.logged = (0.0, 0.0, self.step)  # (waits, train seconds, step) at the last log
        if rt.is_main:
            write_atomic(out_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            if resume_from is not None:  # rows a killed run logged after this checkpoint are trained again
                truncate_metrics(out_dir / "metrics.jsonl", self.step)
        self.logger = (JsonlLogger(out_dir / "metrics.jsonl", resume_from is not None, cfg.output.tensorboard)
                       if rt.is_main else None)
        total = self.max_steps or self.step + self.cursor.steps_left(self.total_samples)
        self.epochs = math.ceil(self.max_steps / self.steps_per_epoch) if self.max_steps else tcfg.epochs
        # Redrawn 10x a second on a terminal; in a log file (CI, nohup) every 10 s is enough.
        self.bar = tqdm(total=total, initial=self.step, desc=output_dir(cfg).name, disable=quiet or not rt.is_main,
                        dynamic_ncols=True, mininterval=0.1 if sys.stderr.isatty() else 10.0)
        self.already_finished = resume_from is not None and self.finished()

    def finished(self) -> bool:
        return self.step >= self.max_steps if self.max_steps else self.cursor.consumed >= self.total_samples

    def progress(self) -> float:
        """step / total, bit for bit, for an uninterrupted run; in samples when the world changed."""
        if self.max_steps:
            return self.step / self.max_steps
        c = self.cursor
        return (c.epoch * self.steps_per_epoch + c.offset / self.global_bs) / (self.epochs * self.steps_per_epoch)

    def move_schedules(self, every: str) -> None:
        """Set scheduled routers' progress when ``train.schedule`` is ``every`` ("step" or "epoch")."""
        if self.tcfg.schedule != every:
            return
        fraction = self.cursor.epoch / self.epochs if every == "epoch" else self.progress()
        for r in self.scheduled:
            r.set_progress(fraction)

    def train_step(self) -> dict:
        """One batch: inputs screened, the step strategy, nothing read back (``maybe_log`` reads)."""
        rt, data = self.rt, self.data
        step_start = time.perf_counter()
        self.step_bytes.clear()  # forwards since the last step (evaluation, records) are not training's
        rows = torch.tensor_split(self.cursor.next_batch(), rt.world)[rt.rank]
        xb, yb = to_device(data.x_train[rows], rt.device), to_device(data.y_train[rows], rt.device)
        cb = data.train_categories(rows)
        cb = None if cb is None else to_device(cb, rt.device)
        xb, bad = screened(xb)  # a NaN / Inf batch runs zeroed and the step is skipped on every rank
        self.tuner.before_step()
        record = self.strategy(self.model, self.step_fn, xb, yb, cb, bad_input=bad, compute=rt.compute())
        self.tuner.after_step()
        if self.tuner.medians and not self.tuner.said:
            self.tuner.said = True
            if rt.is_main:
                self.bar.write(self.tuner.summary())
        self.step_bytes.take()
        self.skipped = self.skipped + record["skipped"]  # on the device; read at log steps
        self.train_seconds += time.perf_counter() - step_start  # this rank's host time in steps
        self.step += 1
        return record

    def maybe_log(self, record: dict, last: bool) -> None:
        """At a log step (and the last): the record averaged over ranks (one read), the skipped steps
        checked against train.max_skipped_steps, the metrics line written."""
        if self.step % self.tcfg.log_every == 0 or last:
            record.update(self._interval_times())
            # the record, the skipped count and the bytes sent: one collective, one read, every rank
            # (rank 0: with the routings its metrics need, in the same transfer)
            # None: every step skipped; no tokens: rank 0's part of GAR's last group was empty
            metrics = self.logger is not None and all(
                layer.last_routing is not None and len(layer.last_routing.expert_idx) for layer in self.layers)
            routings = routing_tensors(self.layers) if metrics else []
            unread = take_unread(self.routers)  # a GPU's router input checks, read in the same transfer
            if unread is not None:
                record[FAILED] = unread[:, 0].max()
            drain = time.perf_counter()
            record, sent, copies = reduced({**record, SKIPPED_SO_FAR: self.skipped}, self.step_bytes.pending(),
                                           self.rt, routings + ([] if unread is None else [unread]))
            if unread is not None:
                raise_failed(copies.pop(), record.pop(FAILED), self.rt.group if self.rt.world > 1 else None)
            # on a GPU the steps' queued work finishes here, in the log step's read: the run's time in
            # training counts it (a logged step_s is the host's, from before)
            self.train_seconds += time.perf_counter() - drain
            self._check_skipped(int(record.pop(SKIPPED_SO_FAR)), record)
            record.update(self.step_bytes.logged(sent))
            if self.logger is not None:
                if metrics:
                    record.update(layers_metrics(host_layer_metrics(self.layers, copies)))
                if isinstance(self.routers[0], Scheduled):
                    record["schedule_progress"] = float(self.routers[0].progress)
                self.logger.log({"step": self.step, **record})
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        self.bar.update(1)

    def _interval_times(self) -> dict:
        """Since the last log, per step: this rank's time in steps and waiting in exchanges (averaged
        over ranks with the record). The waits are read without waiting (on CUDA, timing events not yet
        run count at the next log), so a log step reads the device once, in its reduction."""
        waited = self.waits.read(settled=False)
        steps = self.step - self.logged[2]
        times = {"step_s": (self.train_seconds - self.logged[1]) / steps,
                 "exchange_wait_s": (waited - self.logged[0]) / steps}
        self.logged = (waited, self.train_seconds, self.step)
        return times

    def _check_skipped(self, skipped: int, record: dict) -> None:
        self.skipped_steps = skipped  # agreed by every rank
        tcfg = self.tcfg
        if skipped > tcfg.max_skipped_steps:
            raise ValueError(f"training diverged: {skipped} steps had a non-finite loss or gradients "
                             f"(train.max_skipped_steps={tcfg.max_skipped_steps}) by step {self.step} "
                             f"(loss {record['loss']}); lower train.lr (now {tcfg.lr}){self.strategy.diverged_hint} "
                             "or check the data")

    def check_trained(self) -> None:
        """Refuse a run whose every step was skipped (within train.max_skipped_steps): its model is the one it
        started from, or worse, non-finite; reporting or exporting it as trained would hide that."""
        steps = self.step - self.first_step
        if steps and self.skipped_steps >= steps:
            source = f"the weights and config.json in model.path={self.cfg.model.path!r}" if self.cfg.model.path \
                else "the data and train.lr"
            raise ValueError(f"training took no step: all {steps} steps of this run had a non-finite loss or "
                             f"gradients and were skipped (train.max_skipped_steps={self.tcfg.max_skipped_steps}); "
                             f"check {source}")

    def maybe_checkpoint(self, last: bool) -> None:
        every = self.tcfg.checkpoint_every
        if every and (self.step % every == 0 or last):
            save_state(self.out_dir / "checkpoints", self.step, self.model, self.step_fn.opt, self.cursor, self.rt,
                       config=self.cfg.to_dict(full=True),  # whole: a resume compares it key by key
                       keep=self.tcfg.keep_checkpoints)

    def evaluate(self) -> dict:
        data = self.data
        with self.waits.outside():  # its exchanges are not training's
            return evaluate(self.model, data.x_val, data.y_val, data.val_categories(), runtime=self.rt,
                            max_rows=self.tcfg.eval_rows(self.rt.world))

    def evaluate_epoch(self) -> None:
        self.last_eval = self.evaluate()
        if self.logger is not None:
            self.logger.log({"step": self.step, "epoch": math.ceil(self.cursor.consumed / self.n), **self.last_eval})

    def close(self) -> None:
        self.bar.close()
        if self.logger is not None:
            self.logger.close()

    def trained(self) -> Trained:
        """How far this run trained, how long it took and where it ended, for its summary."""
        return Trained(self.step, self.already_finished, self.cursor.consumed, self.cursor.consumed - self.resumed_at,
                       self.skipped_steps, time.time() - self.start, self.train_seconds, self.exchange_wait_s,
                       self.last_eval)


def export_hf(model, target: Path, rt: Runtime) -> None:
    """Gather the model to the main rank and write it there; every rank learns whether that worked (the
    others wait for the write, up to parallel.timeout_s) and fails as the main rank does."""
    model.export(target, rt.is_main, rt.group if rt.world > 1 else None)


HF_MODEL = "hf_model"  # under output.dir: model.kind hf's trained model, for from_pretrained
SKIPPED_SO_FAR = "skipped so far"  # rides with a logged record's values, popped before it is written


def screened(xb: torch.Tensor):
    """(the batch, zeroed when it holds NaN or Inf; a 0-dim bool on its device, True then), decided
    on the device. Token ids never hold either: (xb, None)."""
    if not xb.is_floating_point():
        return xb, None
    bad = ~torch.isfinite(xb).all()
    return torch.where(bad, torch.zeros_like(xb), xb), bad
