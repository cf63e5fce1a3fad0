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
from dist_moe.models.image import ImageMoE
from dist_moe.routing.gar import gar_train_step, moe_layers
from dist_moe.dispatch.stats import all_gather_rows
from dist_moe.train import checkpoint
from dist_moe.train.align import specdrop_align
from dist_moe.train.data import tabular_split
from dist_moe.train.config import validate
from dist_moe.train.engines import Runtime
from dist_moe.train.metrics import metrics_of, routing_metrics
from placement import random_pair_tree_distance
from placement.simulate import RoutingRecord


def json_safe(record: dict) -> dict:
    """NaN / inf (e.g. tree distance with top-1 routing) become null: strict JSON has no NaN."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


class JsonlLogger:
    def __init__(self, path: Path, append: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("a" if append else "w")

    def log(self, record: dict) -> None:
        self._f.write(json.dumps(json_safe(record)) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


@torch.no_grad()
def evaluate(model: TabularMoE, x: torch.Tensor, y: torch.Tensor, c: torch.Tensor | None = None,
             batch_size: int = 4096, runtime: Runtime | None = None) -> dict:
    """Validation metrics; under a multi-rank runtime each rank takes its share of the rows
    and every sum is reduced (every rank runs the same number of forwards)."""
    world, rank = (runtime.world, runtime.rank) if runtime is not None else (1, 0)
    total = len(x)
    mine = torch.tensor_split(torch.arange(total), world)[rank]
    x, y = x[mine], y[mine]
    c = None if c is None else c[mine]
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # loss, correct, rows
    routings = []
    for rows in torch.tensor_split(torch.arange(len(x)), max(1, math.ceil(math.ceil(total / world) / batch_size))):
        logits, _ = model(x[rows], None if c is None else c[rows])
        sums[0] += float(_loss(logits, y[rows], "sum")) if len(rows) else 0.0
        sums[1] += int((logits.argmax(-1) == y[rows]).sum())
        sums[2] += y[rows].numel()  # rows, or tokens for a language model
        routings.append(model.moe.last_routing)
    reduce = runtime.sum if runtime is not None else (lambda t: t)
    sums = reduce(sums)
    load = reduce(sum(r.stats["load"] for r in routings).double())
    dropped = int(reduce(torch.tensor([float(sum(r.stats.get("dropped", 0) for r in routings))])))
    metrics = routing_metrics(torch.cat([r.expert_idx for r in routings]), load, dropped, model.moe.num_experts)
    out = {"val_loss": float(sums[0] / sums[2]), "val_acc": float(sums[1] / sums[2]),
           **{f"val_{k}": v for k, v in metrics.items()}}
    if c is not None:
        out["val_align"] = _align(model, x, y, c, None if runtime is None or world == 1 else runtime.group)
    model.train()
    return out


def _align(model: TabularMoE, x, y, c, group=None) -> float:
    """SpecDrop's Align on the validation rows (expert c mod E is category c's)."""
    num_categories = int(c.max()) + 1 if model.class_category is None else int(model.class_category.max()) + 1
    e = model.moe.num_experts

    def per_category_loss(m):
        logits, _ = m(x, c)
        losses = _loss(logits, y, "none").double().reshape(len(y), -1).mean(1)  # per row (sequence)
        return (torch.zeros(num_categories, dtype=torch.float64).index_add_(0, c, losses),
                torch.bincount(c, minlength=num_categories).double())

    return specdrop_align(model, per_category_loss, torch.arange(num_categories) % e, e, group)["align"]


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
    """Train the tabular model with ``cfg["engine"]`` over the launched world (one process: local)."""
    validate(cfg)
    runtime = Runtime(cfg["engine"], cfg["parallel"])
    try:
        return _train(cfg, runtime, quiet)
    finally:
        runtime.shutdown()


def _train(cfg: dict, rt: Runtime, quiet: bool) -> dict:
    tcfg = cfg["train"]
    torch.manual_seed(cfg["seed"])  # the same on every rank: replicated modules start identical
    data, model = _data_and_model(cfg, rt)
    router = model.moe.router
    routers = [site.router for site in moe_layers(model)]  # every MoE layer's, for schedules
    gar = getattr(router, "gar_config", None)
    bs = tcfg["batch_size"]  # per rank, as DeepSpeed's train_micro_batch_size_per_gpu
    step_fn = rt.stepper(model, tcfg["lr"], tcfg["max_grad_norm"], bs)
    out_dir = Path(cfg["output"]["dir"].format(name=cfg["name"]))
    ckpt_dir = out_dir / "checkpoints"
    if (tcfg["checkpoint_every"] or tcfg["resume"]) and rt.engine != "torch":
        raise ValueError(f"checkpoints are written for engine torch; with engine {rt.engine!r} use the engine's "
                         "own checkpointing (train.checkpoint_every / train.resume)")
    resume_from = checkpoint.latest(ckpt_dir) if tcfg["resume"] else None
    if rt.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    logger = JsonlLogger(out_dir / "metrics.jsonl", append=resume_from is not None) if rt.is_main else None

    n, global_bs = len(data.x_train), bs * rt.world
    steps_per_epoch = math.ceil(n / global_bs)
    total = tcfg["max_steps"] or tcfg["epochs"] * steps_per_epoch
    gen = torch.Generator().manual_seed(cfg["seed"])  # the same order on every rank; each takes its share
    step, start, last_eval = 0, time.time(), {}
    if resume_from is not None:
        step = _resume(resume_from, model, step_fn.opt, gen, rt)
    # Redrawn 10x a second on a terminal; in a log file (CI, nohup) every 10 s is enough.
    bar = tqdm(total=total, initial=step, desc=cfg["name"], disable=quiet or not rt.is_main, dynamic_ncols=True,
               mininterval=0.1 if sys.stderr.isatty() else 10.0)
    try:
        epochs = math.ceil(total / steps_per_epoch)
        # a router given total_steps counts its own forwards instead
        scheduled = hasattr(router, "set_progress") and getattr(router, "total_steps", None) is None
        while step < total:
            epoch_start = gen.get_state()
            perm = torch.randperm(n, generator=gen)
            if scheduled and tcfg["schedule"] == "epoch":
                for r in routers:
                    r.set_progress((step // steps_per_epoch) / epochs)  # SpecDrop's schedule, per epoch
            for i in range((step % steps_per_epoch) * global_bs, n, global_bs):  # mid-epoch after a resume
                if step >= total:
                    break
                if scheduled and tcfg["schedule"] == "step":
                    for r in routers:
                        r.set_progress(step / total)  # SpecDrop's schedule, per step
                rows = torch.tensor_split(perm[i : i + global_bs], rt.world)[rt.rank]
                xb, yb = data.x_train[rows], data.y_train[rows]
                cb = data.train_categories(rows)
                record = (_gar_step(model, step_fn, xb, yb, cb, gar, tcfg, rt) if gar
                          else _plain_step(step_fn, xb, yb, cb))
                record = _mean_over_ranks(record, rt)
                step += 1
                if not math.isfinite(record["loss"]):  # the same mean on every rank: all stop together
                    raise ValueError(f"training diverged at step {step} (loss {record['loss']}); "
                                     f"lower train.lr (now {tcfg['lr']})")
                if step % tcfg["log_every"] == 0 or step == total:
                    record.update(_measured_bytes(model, rt))  # collective: every rank takes part
                if logger is not None and (step % tcfg["log_every"] == 0 or step == total):
                    record.update(metrics_of(model.moe.last_routing, model.moe.num_experts))
                    if hasattr(router, "progress"):
                        record["schedule_progress"] = float(router.progress)
                    logger.log({"step": step, **record})
                    bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
                bar.update(1)
                if tcfg["checkpoint_every"] and (step % tcfg["checkpoint_every"] == 0 or step == total):
                    # the data order of the epoch holding the next step: this one's, or the next
                    next_epoch = gen.get_state() if step % steps_per_epoch == 0 else epoch_start
                    checkpoint.save(ckpt_dir, step, model, step_fn.opt, _position(step, next_epoch, rt),
                                    rt.group if rt.world > 1 else None)
            last_eval = evaluate(model, data.x_val, data.y_val, data.val_categories(), runtime=rt)
            _measured_bytes(model, rt)  # drop the evaluation's bytes: those logged per step are training bytes
            if logger is not None:
                logger.log({"step": step, "epoch": math.ceil(step / steps_per_epoch), **last_eval})
        _record_routing(out_dir, model, data, rt)
    finally:
        bar.close()
        if logger is not None:
            logger.close()
    summary = {
        "name": cfg["name"], "router": cfg["router"]["type"], "engine": rt.engine, "world_size": rt.world,
        "topology": rt.topology().describe(),
        "steps": step, "seconds": round(time.time() - start, 2), **last_eval,
        "random_pair_tree_distance": _random_pair(model.moe.num_experts), "output_dir": str(out_dir),
    }
    summary = json_safe(summary)
    if rt.is_main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _measured_bytes(model, rt: Runtime) -> dict:
    """Payload bytes dist-moe's dispatchers sent across each topology level since the last log, summed
    over ranks: ``bytes_<level>`` for all MoE layers, ``layer<i>_bytes_<level>`` each when there are several."""
    from dist_moe.layer import MoELayer

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if rt.world == 1 or not layers:
        return {}
    per_layer = [layer.traffic.by_level() for layer in layers]
    for layer in layers:
        layer.reset_traffic()
    names = list(per_layer[0])
    total = rt.sum(torch.tensor([[lv[n] for n in names] for lv in per_layer], dtype=torch.float64))
    out = {f"bytes_{n}": int(v) for n, v in zip(names, total.sum(0).tolist())}
    if len(layers) > 1:
        out.update({f"layer{i}_bytes_{n}": int(v) for i, row in enumerate(total.tolist()) for n, v in zip(names, row)})
    return out


@torch.no_grad()
def _record_routing(out_dir: Path, model, data, rt: Runtime) -> None:
    """routing.npz for `dist-moe report / place / simulate`: every validation token's experts and
    rank; under expert parallelism also the bytes that forward sent, per topology level."""
    rows = torch.tensor_split(torch.arange(len(data.x_val)), rt.world)[rt.rank]
    moe = model.moe
    measured = hasattr(moe, "traffic") and rt.world > 1
    if measured:
        moe.reset_traffic()
    model.eval()
    model(data.x_val[rows], data.val_categories(rows))
    model.train()
    dispatch = None
    if measured:
        levels = moe.traffic.by_level()
        total = rt.sum(torch.tensor(list(levels.values()), dtype=torch.float64)).tolist()
        dispatch = {"topology": moe.topology.describe(), "expert_to_rank": moe.placement.expert_to_rank,
                    "dedup": moe.dedup, "measured_bytes_by_level": dict(zip(levels, map(int, total)))}
        moe.reset_traffic()
    idx = moe.last_routing.expert_idx
    group = rt.group if rt.world > 1 else None
    idx_all = all_gather_rows(idx, group)
    src = all_gather_rows(torch.full((idx.shape[0],), rt.rank, dtype=torch.long), group)
    if rt.is_main:
        RoutingRecord(idx_all, src, moe.num_experts, rt.world, moe.hidden_size * 4, dispatch).save(out_dir)


def _position(step: int, epoch_gen: torch.Tensor, rt: Runtime) -> dict:
    """Where training stands, as tensors: the step, the data order, this rank's RNG."""
    return {"step": torch.tensor(step), "data.epoch_generator": epoch_gen,
            f"rng.world{rt.world}.rank{rt.rank}": torch.get_rng_state()}


def _resume(path: Path, model, opt, gen: torch.Generator, rt: Runtime) -> int:
    """Load ``path`` into the model and optimizer, rewind the data order; returns the step."""
    extra = _position(0, gen.get_state(), rt)
    loaded = checkpoint.load(path, model, opt, extra, rt.group if rt.world > 1 else None)
    if "step" not in loaded or "data.epoch_generator" not in loaded:
        raise ValueError(f"checkpoint {path} has no training position (step, data order)")
    gen.set_state(loaded["data.epoch_generator"])
    rng = f"rng.world{rt.world}.rank{rt.rank}"
    if rng in loaded:  # the same world size: every rank continues its own random stream
        torch.set_rng_state(loaded[rng])
    return int(loaded["step"])


def _mean_over_ranks(record: dict, rt: Runtime) -> dict:
    """Logged losses are the mean over ranks (each rank's is its own micro-batch's)."""
    if rt.world == 1:
        return record
    keys = sorted(record)
    values = rt.sum(torch.tensor([float(record[k]) for k in keys], dtype=torch.float64)) / rt.world
    return dict(zip(keys, values.tolist()))


def _random_pair(num_experts: int) -> float:
    return random_pair_tree_distance(num_experts) if num_experts >= 2 and not num_experts & (num_experts - 1) else None


def _loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over classes ([B, C] vs [B]) or next bytes ([B, S, V] vs [B, S])."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction)


def _data_and_model(cfg: dict, rt: Runtime):
    dcfg, mcfg = cfg["data"], dict(cfg["model"])
    kind, layers, heads = mcfg.pop("kind"), mcfg.pop("layers"), mcfg.pop("heads")
    wants = {"lm": "corpus", "image": "fashion_mnist"}
    if wants.get(kind) != (dcfg["name"] if dcfg["name"] in wants.values() else None):
        raise ValueError(f"model.kind={kind!r} needs data.name={wants.get(kind, 'a keel dataset')}, "
                         f"got {dcfg['name']!r}")
    if kind == "lm":
        from dist_moe.models.tiny_lm import TinyMoELM
        from dist_moe.train.corpus import lm_split

        if mcfg["label_mask"] or not mcfg["d_model"]:
            raise ValueError("model.kind=lm needs model.d_model > 0 and model.label_mask: false")
        data = lm_split(dcfg["seq_len"], dcfg["per_domain"], dcfg["val_fraction"], cfg["seed"], dcfg["categories"])
        router = _categorised_router(cfg, data)
        build = lambda i: rt.build_moe(mcfg["d_model"], mcfg["ffn_hidden_size"], router,  # noqa: E731
                                       mcfg["capacity_factor"], mcfg["expert_type"])
        model = TinyMoELM(build, mcfg["d_model"], layers, heads, max_len=dcfg["seq_len"])
        model.class_category = None  # categories come from the data, not from classes
        return data, model
    data = tabular_split(dcfg["name"], dcfg["val_fraction"], cfg["seed"], dcfg["max_rows"], dcfg["categories"])
    router = _categorised_router(cfg, data)
    features = data.x_train.shape[1]
    moe = rt.build_moe(mcfg["d_model"] or features, mcfg["ffn_hidden_size"], router, mcfg["capacity_factor"],
                       mcfg["expert_type"])
    model_cls = ImageMoE if kind == "image" else TabularMoE
    return data, model_cls(features, data.num_classes, router, class_category=data.class_category, moe=moe, **mcfg)


def _plain_step(step_fn, xb, yb, cb) -> dict:
    logits, aux = step_fn.module(xb, cb)
    task = _loss(logits, yb)
    step_fn(task + aux)
    return {"loss": float(task.detach()), "aux_loss": float(aux.detach())}


def _gar_step(model, step_fn, xb, yb, cb, gar, tcfg, rt: Runtime) -> dict:
    g = tcfg["gar_group_size"]
    if rt.world == 1:  # consecutive groups of g rows
        parts = [torch.arange(i, min(i + g, len(xb))) for i in range(0, len(xb), g)]
    else:  # every rank takes the same number of groups: the m-th of every rank form unit m
        count = max(1, math.ceil(tcfg["batch_size"] / g))
        parts = list(torch.tensor_split(torch.arange(len(xb)), count))
        if any(len(rows) == 0 for rows in parts):
            raise ValueError(f"a rank holds {len(xb)} rows for {count} GAR groups: raise train.batch_size")
    groups = [(xb[r], yb[r], None if cb is None else cb[r]) for r in parts]

    def loss_fn(m, group):
        logits, aux = m(group[0], group[2])
        return _loss(logits, group[1]) + aux

    weights = [len(grp[0]) / len(xb) for grp in groups] if rt.world == 1 else [1 / len(groups)] * len(groups)
    sizes = [len(grp[0]) for grp in groups] if rt.world > 1 else None
    # DeepSpeed owns reduction, clip and step: GAR hands it the accumulated gradients
    finish = getattr(step_fn, "finish_external", None)
    out = gar_train_step(model, groups, loss_fn, step_fn.opt, weights, gar.lam, gar.eps, tcfg["max_grad_norm"],
                         gar.mode, sizes=sizes, unit=gar.unit, finish=finish)
    return {"loss": out["task_loss"], "gar_loss": out["gar_loss"]}
