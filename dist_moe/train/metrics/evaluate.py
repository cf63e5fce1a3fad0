"""Validation metrics for every model kind, reduced over the ranks of a run, and SpecDrop's Align."""
from __future__ import annotations

import contextlib
import math

import torch

from dist_moe.moe.view import moe_layers
from dist_moe.train.align import specdrop_align
from dist_moe.train.metrics.routing import layers_metrics, routing_metrics
from dist_moe.train.step.training_step import loss_of

EVAL_BATCH_ROWS = 4096  # rows a validation forward takes


@torch.no_grad()
def evaluate(model, x: torch.Tensor, y: torch.Tensor, c: torch.Tensor | None = None,
             batch_size: int = EVAL_BATCH_ROWS, runtime=None, max_rows: int | None = None) -> dict:
    """Validation metrics on the first ``max_rows`` rows (None: all), ``batch_size`` rows a forward; under a multi-rank
    runtime each rank takes its share of them and every sum is reduced (every rank runs the same number
    of forwards)."""
    world, rank = (runtime.world, runtime.rank) if runtime is not None else (1, 0)
    device = next(model.parameters()).device
    mine, batches = shared_rows(min(len(x), max_rows or len(x)), world, rank, batch_size)
    x, y = x[mine].to(device), y[mine].to(device)
    c = None if c is None else c[mine].to(device)
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # loss, correct, rows
    layers = moe_layers(model)
    routings = [[] for _ in layers]  # per MoE layer, per batch
    for rows in batches:
        with runtime.compute() if runtime is not None else contextlib.nullcontext():  # train.precision
            logits, _ = model(x[rows], None if c is None else c[rows])
        logits = logits.float()
        sums[0] += float(loss_of(logits, y[rows], "sum")) if len(rows) else 0.0
        sums[1] += int((logits.argmax(-1) == y[rows]).sum())
        sums[2] += y[rows].numel()  # rows, or tokens for a language model
        for per_batch, layer in zip(routings, layers):
            per_batch.append(layer.last_routing)
    reduce = runtime.sum if runtime is not None else (lambda t: t)
    sums = reduce(sums)
    metrics = layers_metrics([_val_metrics(layer, per_batch, reduce) for layer, per_batch in zip(layers, routings)])
    out = {"val_loss": float(sums[0] / sums[2]), "val_acc": float(sums[1] / sums[2]),
           **{f"val_{k}": v for k, v in metrics.items()}}
    # Align asks of SpecDrop's category assignment (expert c mod E)
    if c is not None and "categories" in layers[0].router.inputs:
        out["val_align"] = _align(model, x, y, c, None if runtime is None or world == 1 else runtime.group)
    model.train()
    return out


def shared_rows(total: int, world: int, rank: int, batch_size: int = EVAL_BATCH_ROWS) \
        -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's share of the first ``total`` validation rows, and its forwards' positions in that share
    (``batch_size`` rows at most): as many forwards on every rank (each takes part in every exchange)."""
    mine = torch.tensor_split(torch.arange(total), world)[rank]
    forwards = max(1, math.ceil(math.ceil(total / world) / batch_size))
    return mine, list(torch.tensor_split(torch.arange(len(mine)), forwards))


def _val_metrics(layer, routings: list, reduce) -> dict:
    """One MoE layer's routing metrics over every validation batch, loads summed over ranks."""
    load = reduce(sum(r.stats["load"] for r in routings).double())
    dropped = int(reduce(torch.tensor([float(sum(r.stats.get("dropped", 0) for r in routings))])))
    return routing_metrics(torch.cat([r.expert_idx for r in routings]), load, dropped, layer.num_experts,
                           layer.expert_node, layer.expert_rank)


def _align(model, x, y, c, group=None) -> float:
    """SpecDrop's Align on the validation rows (expert c mod E is category c's)."""
    num_categories = int(c.max()) + 1 if model.class_category is None else int(model.class_category.max()) + 1
    e = moe_layers(model)[0].num_experts

    def per_category_loss(m):
        logits, _ = m(x, c)
        losses = loss_of(logits, y, "none").double().reshape(len(y), -1).mean(1)  # per row (sequence)
        return (torch.zeros(num_categories, dtype=torch.float64, device=c.device).index_add_(0, c, losses),
                torch.bincount(c, minlength=num_categories).double())

    return specdrop_align(model, per_category_loss, torch.arange(num_categories, device=c.device) % e, e,
                          group)["align"]


