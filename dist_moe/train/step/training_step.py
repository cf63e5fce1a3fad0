"""One training step, chosen once per run: plain (task loss + aux loss, one backward) or GAR
(Algorithm 1 over observation groups of the batch, ``train.gar``)."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from dist_moe.distributed.reductions import all_reduce_max
from dist_moe.routing.buffers import buffers_of, put_back, put_back_if
from dist_moe.train.run_config import TrainConfig
from dist_moe.train.step.gar_step import equal_task_weights, gar_train_step


def loss_of(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The task loss a training step minimises (evaluation reports it too): cross-entropy over
    classes ([B, C] vs [B]) or next bytes ([B, S, V] vs [B, S])."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction)


def step_strategy(tcfg: TrainConfig, rt):
    """``PlainStep``, or a ``GARStep`` when ``train.gar`` is set: ``(model, stepper, x, y, categories) -> record``."""
    return PlainStep() if tcfg.gar is None else GARStep(tcfg, rt)


class PlainStep:
    # what else a diverged run may lower, beside train.lr
    diverged_hint = ""

    def __call__(self, model, step_fn, xb, yb, cb, bad_input=None, compute=None) -> dict:
        """One step, decided on the device. When the loss or gradients are not finite on any rank, or
        ``bad_input`` (a 0-dim bool: this rank's batch held NaN / Inf and was zeroed) is set on any rank,
        every rank skips the update and restores the buffers the forward moved, so the bad batch leaves
        no trace but its count (train.max_skipped_steps). ``compute``: the forward's context
        (``Runtime.compute``, autocast under train.precision bf16). The record holds device scalars."""
        saved = buffers_of(model)
        with compute if compute is not None else contextlib.nullcontext():
            logits, aux = step_fn.module(xb, cb)
        # a rank left without rows (the epoch's last, short batch) still runs the step's collectives
        task = loss_of(logits.float(), yb) if yb.numel() else logits.sum().float() * 0.0
        if bad_input is not None:  # NaN: the step is skipped on every rank, its loss logged as NaN
            task = task + torch.where(bad_input, math.nan, 0.0)
        skipped = step_fn(task + aux)
        put_back_if(model, saved, skipped)
        return {"loss": task.detach(), "aux_loss": aux.detach(), "skipped": skipped}


def category_counts(cb: torch.Tensor, rt) -> torch.Tensor:
    """[world, categories]: how many rows of each category every rank holds this step."""
    group = rt.group if rt.world > 1 else None
    num = all_reduce_max(int(cb.max()) + 1 if cb.numel() else 0, group)
    counts = torch.zeros(rt.world, num, dtype=torch.long, device=cb.device)
    counts[rt.rank] = torch.bincount(cb, minlength=num)
    return rt.sum(counts)


def same_category_units(cb: torch.Tensor, g: int, rank: int, counts: torch.Tensor):
    """The paper's same-task groups: each category's rows of the whole batch (rank 0's, then rank
    1's, ..., as the batch was cut) in runs of up to ``g``. Returns, per unit, its category, this
    rank's rows of it (maybe none) and its rows over all ranks; every rank lists the same units, so
    one process gets the groups it would form alone."""
    before, total = counts[:rank].sum(0), counts.sum(0)
    tasks, parts, sizes = [], [], []
    for c in range(counts.shape[1]):
        rows = (cb == c).nonzero().squeeze(1)
        position = int(before[c]) + torch.arange(len(rows), device=cb.device)  # among the batch's rows of c
        for start in range(0, int(total[c]), g):
            tasks.append(c)
            parts.append(rows[(position >= start) & (position < start + g)])
            sizes.append(min(g, int(total[c]) - start))
    return tasks, parts, sizes


class GARStep:
    """GAR's step: the batch cut into observation groups (``train.gar_group_size`` rows, consecutive or
    of one category each, the latter formed over every rank's rows), then ``gar_train_step``. A step
    whose losses or gradients (L_norm's included) are not finite is skipped and counted as a plain one."""

    def __init__(self, tcfg: TrainConfig, rt):
        self.gar, self.tcfg, self.rt = tcfg.gar, tcfg, rt
        self.diverged_hint = " or train.gar." + ("share" if tcfg.gar.share is not None else "lambda")
        # over ranks, a rank's part of a same-task group may be empty: only dist-moe's own MoE layer is
        # tested with empty forwards (every rank raises this alike, before any step)
        if tcfg.gar_groups == "same_category" and rt.world > 1 and rt.engine.name != "torch":
            raise ValueError(f"train.gar_groups=same_category over {rt.world} ranks needs engine=torch, "
                             f"got engine={rt.engine.name}")
        if rt.layout.replicas > 1:  # its reductions, clip and step treat an expert's gradient as its group's whole
            raise ValueError(f"train.gar with parallel.ep_size={rt.ep_size} of {rt.world} ranks: GAR sums each "
                             "expert's observations and gradients over its expert-parallel group, and summing them "
                             "over the experts' replicas as well is not built; set parallel.ep_size to the world "
                             "or train without train.gar")

    def __call__(self, model, step_fn, xb, yb, cb, bad_input=None, compute=None) -> dict:
        """One GAR step (fp32 only: the config refuses bf16 with GAR); it reads its checks back to the
        host, as GAR's per-group backwards and lambda need."""
        gar, tcfg, rt = self.gar, self.tcfg, self.rt
        if bad_input is not None and float(rt.sum(bad_input.float())) > 0:  # agreed before any forward
            return {"loss": math.nan, "skipped": 1.0}
        g = tcfg.gar_group_size
        if tcfg.gar_groups == "same_category":
            if cb is None:
                raise ValueError("train.gar_groups=same_category needs categories (e.g. text tasks)")
            tasks, parts, unit_sizes = same_category_units(cb, g, rt.rank, category_counts(cb, rt))
            # tasks weigh equally, examples equally within a task, counted over every rank
            weights = equal_task_weights(tasks, unit_sizes)
        elif rt.world == 1:  # consecutive groups of g rows
            parts = [torch.arange(i, min(i + g, len(xb))) for i in range(0, len(xb), g)]
            weights = [len(rows) / len(xb) for rows in parts]
        else:  # every rank takes the same number of groups: the m-th of every rank form unit m
            count = max(1, math.ceil(tcfg.batch_size / g))
            parts = list(torch.tensor_split(torch.arange(len(xb)), count))
            if any(len(rows) == 0 for rows in parts):
                raise ValueError(f"a rank holds {len(xb)} rows for {count} GAR groups: raise train.batch_size")
            weights = [1 / len(parts)] * len(parts)
        sizes = [len(rows) for rows in parts] if rt.world > 1 else None  # this rank's part of each unit
        groups = [(xb[r], yb[r], None if cb is None else cb[r]) for r in parts]
        saved = buffers_of(model)

        def loss_fn(m, group):
            logits, aux = m(group[0], group[2])
            # a rank's empty part of a unit still runs the forward (its exchanges); its loss weighs 0
            return (loss_of(logits, group[1]) if group[1].numel() else logits.sum() * 0.0) + aux

        # DeepSpeed owns reduction, clip and step: GAR hands it the accumulated gradients
        out = gar_train_step(model, groups, loss_fn, step_fn.opt, weights, sizes, step_fn.finish_external, gar=gar,
                             max_grad_norm=tcfg.max_grad_norm)
        if not out["stepped"]:  # a skipped step leaves no trace but its count
            put_back(model, saved)
        record = {"loss": out["task_loss"], "gar_loss": out["gar_loss"], "skipped": 0.0 if out["stepped"] else 1.0}
        if gar.share is not None:  # the lambda this step's gradients set (train.gar.share)
            record["gar_lambda"] = out["lambda"]
        return record
