"""Single-process trainer for the tabular reference model.

Writes ``metrics.jsonl`` (one line per logged step and per evaluation),
``config.yaml`` and ``summary.json`` to the output directory; shows tqdm
progress. A router with a ``gar`` block trains with GAR (Algorithm 1) using
example groups of ``train.gar_group_size`` as observation units; its matched
baseline is the same config with ``gar.lambda: 0`` (same grouped forwards and
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
import torch.nn.functional as F
import yaml
from tqdm import tqdm

from dist_moe.models import TabularMoE
from dist_moe.routing.gar import gar_train_step
from dist_moe.train.align import specdrop_align
from dist_moe.train.data import tabular_split
from dist_moe.train.config import validate
from dist_moe.train.metrics import metrics_of, routing_metrics
from placement import random_pair_tree_distance


def json_safe(record: dict) -> dict:
    """NaN / inf (e.g. tree distance with top-1 routing) become null: strict JSON has no NaN."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


class JsonlLogger:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("w")

    def log(self, record: dict) -> None:
        self._f.write(json.dumps(json_safe(record)) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


@torch.no_grad()
def evaluate(model: TabularMoE, x: torch.Tensor, y: torch.Tensor, c: torch.Tensor | None = None,
             batch_size: int = 4096) -> dict:
    model.eval()
    loss, correct, routings = 0.0, 0, []
    for i in range(0, len(x), batch_size):
        logits, _ = model(x[i : i + batch_size], None if c is None else c[i : i + batch_size])
        loss += float(F.cross_entropy(logits, y[i : i + batch_size], reduction="sum"))
        correct += int((logits.argmax(1) == y[i : i + batch_size]).sum())
        routings.append(model.moe.last_routing)
    metrics = routing_metrics(
        torch.cat([r.expert_idx for r in routings]),
        sum(r.stats["load"] for r in routings),
        sum(r.stats.get("dropped", 0) for r in routings),
        model.moe.num_experts,
    )
    out = {"val_loss": loss / len(x), "val_acc": correct / len(x), **{f"val_{k}": v for k, v in metrics.items()}}
    if c is not None:
        out["val_align"] = _align(model, x, y, c)
    model.train()
    return out


def _align(model: TabularMoE, x, y, c) -> float:
    """SpecDrop's Align on the validation rows (expert c mod E is category c's)."""
    num_categories = int(model.class_category.max()) + 1
    e = model.moe.num_experts

    def per_category_loss(m):
        logits, _ = m(x, c)
        losses = F.cross_entropy(logits, y, reduction="none").double()
        return (torch.zeros(num_categories, dtype=torch.float64).index_add_(0, c, losses),
                torch.bincount(c, minlength=num_categories).double())

    return specdrop_align(model, per_category_loss, torch.arange(num_categories) % e, e)["align"]


def _categorised_router(cfg: dict, data) -> dict:
    """The router config, with SpecDrop's num_categories taken from the data when not given."""
    router = dict(cfg["router"])
    if router["type"] != "specdrop":
        return router
    if data.category_names is None:
        raise ValueError("router.type=specdrop routes by category: set data.categories "
                         "(e.g. satimage_landcover with data.name=satimage)")
    n = len(data.category_names)
    if router.setdefault("num_categories", n) != n:
        raise ValueError(f"router.num_categories={router['num_categories']!r} but data.categories="
                         f"{cfg['data']['categories']!r} has {n} categories")
    return router


def train(cfg: dict, quiet: bool = False) -> dict:
    validate(cfg)
    tcfg = cfg["train"]
    torch.manual_seed(cfg["seed"])
    dcfg = cfg["data"]
    data = tabular_split(dcfg["name"], dcfg["val_fraction"], cfg["seed"], dcfg["max_rows"], dcfg["categories"])
    model = TabularMoE(data.x_train.shape[1], data.num_classes, _categorised_router(cfg, data),
                       class_category=data.class_category, **cfg["model"])
    router = model.moe.router
    opt = torch.optim.Adam(model.parameters(), lr=tcfg["lr"])
    out_dir = Path(cfg["output"]["dir"].format(name=cfg["name"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    logger = JsonlLogger(out_dir / "metrics.jsonl")

    n, bs = len(data.x_train), tcfg["batch_size"]
    steps_per_epoch = math.ceil(n / bs)
    total = tcfg["max_steps"] or tcfg["epochs"] * steps_per_epoch
    gen = torch.Generator().manual_seed(cfg["seed"])
    gar = getattr(router, "gar_config", None)
    step, start, last_eval = 0, time.time(), {}
    # Redrawn 10x a second on a terminal; in a log file (CI, nohup) every 10 s is enough.
    bar = tqdm(total=total, desc=cfg["name"], disable=quiet, dynamic_ncols=True,
               mininterval=0.1 if sys.stderr.isatty() else 10.0)
    try:
        epochs = math.ceil(total / steps_per_epoch)
        # a router given total_steps counts its own forwards instead
        scheduled = hasattr(router, "set_progress") and getattr(router, "total_steps", None) is None
        while step < total:
            perm = torch.randperm(n, generator=gen)
            if scheduled and tcfg["schedule"] == "epoch":
                router.set_progress((step // steps_per_epoch) / epochs)  # SpecDrop's schedule, per epoch
            for i in range(0, n, bs):
                if step >= total:
                    break
                if scheduled and tcfg["schedule"] == "step":
                    router.set_progress(step / total)  # SpecDrop's schedule, per step
                xb, yb = data.x_train[perm[i : i + bs]], data.y_train[perm[i : i + bs]]
                cb = data.categories(yb)
                record = (_gar_step(model, opt, xb, yb, cb, gar, tcfg) if gar
                          else _plain_step(model, opt, xb, yb, cb, tcfg))
                step += 1
                if not math.isfinite(record["loss"]):
                    raise ValueError(f"training diverged at step {step} (loss {record['loss']}); "
                                     f"lower train.lr (now {tcfg['lr']})")
                if step % tcfg["log_every"] == 0 or step == total:
                    record.update(metrics_of(model.moe.last_routing, model.moe.num_experts))
                    if hasattr(router, "progress"):
                        record["schedule_progress"] = float(router.progress)
                    logger.log({"step": step, **record})
                    bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
                bar.update(1)
            last_eval = evaluate(model, data.x_val, data.y_val, data.categories(data.y_val))
            logger.log({"step": step, "epoch": math.ceil(step / steps_per_epoch), **last_eval})
    finally:
        bar.close()
        logger.close()
    summary = {
        "name": cfg["name"], "router": cfg["router"]["type"], "steps": step, "seconds": round(time.time() - start, 2),
        **last_eval, "random_pair_tree_distance": _random_pair(model.moe.num_experts), "output_dir": str(out_dir),
    }
    summary = json_safe(summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _random_pair(num_experts: int) -> float:
    return random_pair_tree_distance(num_experts) if num_experts >= 2 and not num_experts & (num_experts - 1) else None


def _plain_step(model, opt, xb, yb, cb, tcfg) -> dict:
    logits, aux = model(xb, cb)
    task = F.cross_entropy(logits, yb)
    opt.zero_grad(set_to_none=True)
    (task + aux).backward()
    if tcfg["max_grad_norm"]:
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg["max_grad_norm"])
    opt.step()
    return {"loss": float(task.detach()), "aux_loss": float(aux.detach())}


def _gar_step(model, opt, xb, yb, cb, gar, tcfg) -> dict:
    g = tcfg["gar_group_size"]
    groups = [(xb[i : i + g], yb[i : i + g], None if cb is None else cb[i : i + g]) for i in range(0, len(xb), g)]

    def loss_fn(m, group):
        logits, aux = m(group[0], group[2])
        return F.cross_entropy(logits, group[1]) + aux

    weights = [len(grp[0]) / len(xb) for grp in groups]
    out = gar_train_step(model, groups, loss_fn, opt, weights, gar.lam, gar.eps, tcfg["max_grad_norm"], gar.mode,
                         unit=gar.unit)
    return {"loss": out["task_loss"], "gar_loss": out["gar_loss"]}
