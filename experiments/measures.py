"""What each experiment measures beyond the trainer's summary.

``after_*`` run on every rank with the trained model (``train(after=...)``);
``post_*`` run on rank 0 from the run's directory once training is over.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from dist_moe.cli.plan import recorded_routing
from dist_moe.moe.view import moe_layers
from dist_moe.train.layout_choice import moe_shape
from dist_moe.train.metrics.experts import contingency, gradient_mass_purity, lvar, nmi, utilization
from dist_moe.train.metrics.step_bytes import per_step_traffic
from dist_moe.train.step.training_step import loss_of
from placement import Topology
from placement import Topology as Topo
from placement.calibrate import calibrate, replay_dispatch, slowest, to_yaml
from placement.ep_groups import ExpertLayout
from placement.files import write_atomic
from placement.forecast import TFLOPS_RANGE
from placement.layouts import price_layouts
from placement.report import analyze
from placement.simulate import RoutingRecord, recorded_layers, simulate

CLUSTER = "node=2,gpu=2"  # the experiments' 4 ranks as 2 nodes x 2


def post_routing_bytes(summary: dict, cfg) -> dict:
    """Node-crossing copies per token (bytes / token bytes) of the run's validation routing
    under every placement the report compares and every dedup mode, on 2 nodes x 2."""
    record = RoutingRecord.load(summary["output_dir"])
    report = analyze(record, Topology.parse(CLUSTER), cfg.parallel.placement)
    out = {"lower_bound_copies": report["node_lower_bound_bytes_per_token"] / record.token_bytes}
    for placement, entry in report["placements"].items():
        for dedup, mode in entry["modes"].items():
            out[f"copies_{placement}_{dedup}"] = mode["bytes_per_token_by_level"]["node"] / record.token_bytes
            out[f"est_s_{placement}_{dedup}"] = mode["estimated_seconds"]
    if "run_dispatch" in report:
        run = report["run_dispatch"]
        out["measured_equals_analytic"] = all(
            int(run["measured_bytes_by_level"][k]) == int(v) for k, v in run["analytic_bytes_by_level"].items())
    return out


def after_gar_diagnostics(model, data, rt, group_size: int = 8, batches_per_task: int = 8) -> dict:
    """The GAR paper's appendix E diagnostics on the validation split.

    Load vector: per-example mean over valid tokens of the post-top-k gates, summed over
    examples (FFN routing). NMI from the task x expert contingency of token selections
    (slots with a non-zero gate).
    Gradient-mass purity from per-task expert-gradient observations: up to
    ``batches_per_task`` same-task micro-batches of ``group_size`` validation examples,
    each micro-batch's mean-loss gradient, averaged within the task.
    Under expert parallelism rank 0 feeds every batch and the other ranks an empty part (they
    serve their experts and join the exchanges); sums and each rank's experts' gradients are
    reduced over the ranks, so every number is the one a single process computes. CPU only, as
    the experiments run (the accumulators are CPU tensors).
    """
    moe, num_tasks = model.moe, len(data.task_classes)
    e = moe.num_experts
    x, y, t = data.x_val, data.y_val, data.val_categories()

    def fed(rows):  # rank 0's rows; the others run the same forwards on none
        return rows if rt.rank == 0 else rows[:0]

    load = torch.zeros(e, dtype=torch.float64)
    table = torch.zeros(num_tasks, e, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for rows in torch.split(torch.arange(len(x)), 256):
            rows = fed(rows)
            model(x[rows], t[rows])
            routing, ((b, s), padding) = moe.last_routing, moe.last_forward.layout
            valid = ~padding.reshape(-1)
            gates = routing.dense_gates().double().reshape(b, s, e) * valid.reshape(b, s, 1)
            load += (gates.sum(1) / valid.reshape(b, s).sum(1, keepdim=True).clamp_min(1)).sum(0)
            chosen = torch.where(routing.gates > 0, routing.expert_idx, -1)  # a zero-gated slot selects nothing
            table += contingency(t[rows].repeat_interleave(s)[valid], chosen[valid], num_tasks, e)
    template = moe.experts.template()
    local = torch.as_tensor(moe.local_expert_ids)
    grads = torch.zeros(num_tasks, e, sum(p[0].numel() for p in template.values()), dtype=torch.float64)
    for task in range(num_tasks):
        rows = (t == task).nonzero().squeeze(1)[: group_size * batches_per_task]
        chunks = torch.split(rows, group_size)
        for chunk in chunks:
            chunk = fed(chunk)
            model.zero_grad(set_to_none=True)
            logits, _ = model(x[chunk], t[chunk])
            (loss_of(logits, y[chunk]) if len(chunk) else logits.sum() * 0.0).backward()
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(len(local), -1).double()
                              for p in template.values()], dim=1)
            grads[task, local] += flat / len(chunks)
    model.zero_grad(set_to_none=True)
    model.train()
    load, table, grads = rt.sum(load), rt.sum(table), rt.sum(grads)
    return {"lvar": lvar(load), "utilization": utilization(load), "gradient_purity": gradient_mass_purity(grads),
            "nmi": nmi(table), "val_macro_acc": _macro_accuracy(model, x, y, t, num_tasks, rt, fed)}


def _macro_accuracy(model, x, y, t, num_tasks: int, rt, fed) -> float:
    """Equal-task macro validation accuracy (tasks weigh the same whatever their size)."""
    right = torch.zeros(2, num_tasks, dtype=torch.float64)  # correct, rows
    model.eval()
    with torch.no_grad():
        for rows in torch.split(torch.arange(len(x)), 256):
            rows = fed(rows)
            pred = model(x[rows], t[rows])[0].argmax(-1)
            right[0].index_add_(0, t[rows], (pred == y[rows]).double())
            right[1].index_add_(0, t[rows], torch.ones(len(rows), dtype=torch.float64))
    model.train()
    right = rt.sum(right)
    accs = [float(right[0, k] / right[1, k]) for k in range(num_tasks) if right[1, k] > 0]
    return sum(accs) / len(accs)


def after_masking(model, data, rt) -> dict:
    """SpecDrop's masking gain: validation accuracy with logits outside the row's category
    masked, minus without, and the share of predictions that leave the given category.
    Reduced over ranks (each rank takes its share of the rows). Models without a
    class -> category map (the LM) report nothing."""
    if getattr(model, "class_category", None) is None:
        return {}
    rows = torch.tensor_split(torch.arange(len(data.x_val)), rt.world)[rt.rank]
    x, y, c = data.x_val[rows], data.y_val[rows], data.val_categories(rows)
    sums = torch.zeros(4, dtype=torch.float64)  # correct, correct masked, left category, rows
    model.eval()
    with torch.no_grad():
        for part in torch.split(torch.arange(len(x)), 1024):
            logits, _ = model(x[part], c[part])
            outside = model.class_category.unsqueeze(0) != c[part].unsqueeze(1)
            pred, masked = logits.argmax(-1), logits.masked_fill(outside, float("-inf")).argmax(-1)
            sums += torch.tensor([float((pred == y[part]).sum()), float((masked == y[part]).sum()),
                                  float((model.class_category[pred] != c[part]).sum()), float(len(part))],
                                 dtype=torch.float64)
    model.train()
    sums = rt.sum(sums)
    return {"val_acc_masked": float(sums[1] / sums[3]), "masking_gain": float((sums[1] - sums[0]) / sums[3]),
            "left_category": float(sums[2] / sums[3])}


STEP_BATCH = 16  # sequences per rank of the throughput plans' steps (train.batch_size)


def after_exchange_time(model, data, rt) -> dict:
    """The all-to-all seconds of one training step, measured: each MoE layer's dispatch bytes for
    one training batch per rank (a forward), summed over ranks into its [W, W] matrix and replayed
    with ``all_to_all_single`` (``benchmarks/dispatch_time.py``'s replay; node dedup: its cross-node
    hop, then its intra-node hop), four exchanges per layer per step (dispatch and combine,
    forward and backward). Median of 5, the slowest rank's."""

    # dist-moe's dispatcher, exchanging
    layers = [m for m in moe_layers(model) if getattr(getattr(m, "dispatcher", None), "exchanges", False)]
    if not layers:
        return {}
    batch = data.x_train[torch.randperm(len(data.x_train))[:STEP_BATCH]].to(rt.device)
    for layer in layers:
        layer.reset_traffic()
    model.eval()
    with torch.no_grad():
        model(batch)
    model.train()
    seconds = 0.0
    for layer in layers:
        matrix = layer.traffic.matrix.clone()
        dist.all_reduce(matrix)
        seconds += 4 * slowest(lambda m=matrix: replay_dispatch(m, layer.topology, layer.dedup))
    return {"measured_a2a_s": seconds}


_FITTED = {}  # the link calibration of this launch: "cost" -> CostModel


def before_calibrate() -> dict:
    """Fit the cost model on this launch's links (``dist-moe calibrate``'s sweeps)."""
    topo = Topo.from_env()
    cost = calibrate(topo)
    _FITTED["cost"] = cost
    return {"calibration": to_yaml(topo, cost)["cost"], "exchange": to_yaml(topo, cost)["exchange"]}


def before_calibrate_topology() -> dict:
    """``before_calibrate``, its fit written as a topology file that DIST_MOE_TOPOLOGY names for the runs that
    follow (so ``parallel.ep_size: auto`` prices this launch's links; every rank's fit is the same)."""
    row = before_calibrate()
    path = Path(tempfile.gettempdir()) / f"dist-moe-calibrated-{os.getpid()}.yaml"
    write_atomic(path, yaml.safe_dump(to_yaml(Topo.from_env(), _FITTED["cost"])))
    os.environ["DIST_MOE_TOPOLOGY"] = str(path)
    return row


def post_layout_step(summary: dict, cfg) -> dict:
    """Measured step time and tokens/s of an expert-parallel layout; the experts' gradient bytes each step sent
    across each level (every rank's, as logged) and the analytic ring count (``placement.layouts``'s); and
    ``dist-moe plan``'s price of the run's layout on this launch's calibrated links (``plan --routing RUN``:
    its group's exchanges from the run's recorded routing with the run's placement and dedup, and the
    gradients' ring all-reduce over the replicas), the matmuls left out (priced at a rate that makes them
    nothing): the communication plan adds to a step's compute."""
    out = Path(summary["output_dir"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    topo = Topology.from_env()
    topo = Topology(topo.levels, topo.sizes, _FITTED["cost"])
    layout = ExpertLayout(topo, summary["ep_size"], summary.get("ep_layout", "contiguous"))  # one group: none said
    shape = moe_shape(cfg)
    measured = {level: sum(r.get(f"grad_bytes_{level}", 0) for r in rows if "loss" in r) / summary["steps"]
                for level in topo.levels}
    plan = price_layouts(shape, topo, recorded_routing(str(out), shape.experts, shape.top_k), TFLOPS_RANGE[1])
    priced = next(x for x in plan["layouts"] if (x["ep"], x["layout"]) == (layout.ep_size, layout.layout))
    dedup = [x for x in priced["rows"] if x["dedup"] == cfg.parallel.dedup]
    exchange = next((x for x in dedup if x["placement"] == cfg.parallel.placement), dedup[0])["step_seconds"]
    step_s = summary["train_seconds"] / summary["steps"]
    return {"step_s": step_s, "tokens_per_s": shape.tokens_per_rank * summary["world_size"] / step_s,
            "exchange_wait_step_s": summary.get("exchange_wait_s", 0.0) / summary["steps"],
            # the ring count of every replica group's sums, as plan prices them
            "grad_bytes_per_step": measured, "grad_bytes_analytic": priced["grad_bytes_by_level"],
            "plan_exchange_s": exchange, "plan_grad_s": priced["grad_seconds"]}


def post_step_prediction(summary: dict, cfg) -> dict:
    """Measured step time and tokens/s, and the cost model's all-to-all seconds per step.

    Per MoE layer and step the model counts four all-to-alls (dispatch and combine, forward
    and backward) priced on the calibrated links. Their bytes are what the training steps sent
    (``train_traffic.json``: each layer's [W, W] bytes per step, summed over ranks), or, for runs
    from before it was written, a dispatch of batch x seq_len tokens per rank drawn from the run's
    recorded validation routing (``placement.simulate``) under the run's placement and dedup.
    """
    topo = Topology.from_env()
    topo = Topology(topo.levels, topo.sizes, _FITTED.get("cost"))
    dedup = cfg.parallel.dedup
    tokens_per_rank = cfg.train.batch_size * cfg.data.seq_len
    steps_traffic = per_step_traffic(summary["output_dir"], topo)
    if steps_traffic is not None:
        hops = [topo.cost.hop_seconds(t, dedup) for t in steps_traffic]
        comm = sum(4 * topo.cost.estimate(t, dedup) for t in steps_traffic)
    else:
        sims = [simulate(RoutingRecord.load(summary["output_dir"], layer), topo, cfg.parallel.placement,
                         tokens_per_rank=tokens_per_rank)["modes"][dedup]
                for layer in range(recorded_layers(summary["output_dir"]))]
        hops, comm = [s["hop_seconds"] for s in sims], sum(4 * s["estimated_seconds"] for s in sims)
    step_s = summary["train_seconds"] / summary["steps"]
    return {"step_s": step_s, "tokens_per_s": tokens_per_rank * summary["world_size"] / step_s,
            # measured inside the training steps: time blocked in the dispatcher's exchanges
            "exchange_wait_step_s": summary.get("exchange_wait_s", 0.0) / summary["steps"],
            "predicted_comm_s": comm, "predicted_hop_s": hops,
            "priced_from": "validation routing" if steps_traffic is None else "training steps",
            "calibrated": bool(_FITTED)}
