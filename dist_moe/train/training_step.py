"""One training step, chosen once per run: plain (task loss + aux loss, one backward) or GAR
(Algorithm 1 over observation groups of the batch, ``train.gar``)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dist_moe.gar.step import equal_task_weights, gar_train_step
from dist_moe.train.run_config import TrainConfig


def loss_of(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The task loss a training step minimises (evaluation reports it too): cross-entropy over
    classes ([B, C] vs [B]) or next bytes ([B, S, V] vs [B, S])."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction)


def step_strategy(tcfg: TrainConfig, rt):
    """``PlainStep``, or a ``GARStep`` when ``train.gar`` is set: ``(model, stepper, x, y, categories) -> record``."""
    return PlainStep() if tcfg.gar is None else GARStep(tcfg, rt)


class PlainStep:
    stops_on_nan = False  # a non-finite step is skipped and counted (train.max_skipped_steps)

    def __call__(self, model, step_fn, xb, yb, cb) -> dict:
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


class GARStep:
    """GAR's step: the batch cut into observation groups (``train.gar_group_size`` rows, consecutive or
    of one category each), then ``gar_train_step``. A non-finite loss stops the run."""

    stops_on_nan = True

    def __init__(self, tcfg: TrainConfig, rt):
        self.gar, self.tcfg, self.rt = tcfg.gar, tcfg, rt

    def __call__(self, model, step_fn, xb, yb, cb) -> dict:
        gar, tcfg, rt = self.gar, self.tcfg, self.rt
        g = tcfg.gar_group_size
        same_category = tcfg.gar_groups == "same_category"
        if same_category and (cb is None or rt.world > 1):
            raise ValueError("train.gar_groups=same_category needs categories (e.g. text tasks) and one process")
        if same_category:  # the paper's same-task groups: up to g rows of one category each
            parts = [rows[i : i + g] for c in cb.unique().tolist()
                     for rows in [(cb == c).nonzero().squeeze(1)] for i in range(0, len(rows), g)]
        elif rt.world == 1:  # consecutive groups of g rows
            parts = [torch.arange(i, min(i + g, len(xb))) for i in range(0, len(xb), g)]
        else:  # every rank takes the same number of groups: the m-th of every rank form unit m
            count = max(1, math.ceil(tcfg.batch_size / g))
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
        out = gar_train_step(model, groups, loss_fn, step_fn.opt, weights, gar.lam, gar.eps, tcfg.max_grad_norm,
                             gar.mode, sizes=sizes, unit=gar.unit, finish=step_fn.finish_external, share=gar.share)
        record = {"loss": out["task_loss"], "gar_loss": out["gar_loss"]}
        if gar.share is not None:  # the lambda this step's gradients set (train.gar.share)
            record["gar_lambda"] = out["lambda"]
        return record
