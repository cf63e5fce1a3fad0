"""``parallel.ep_size: auto``: the expert-parallel layout ``dist-moe plan`` prices fastest for this run's MoE
layers on the launched topology (its link rates: a calibrated topology YAML in DIST_MOE_TOPOLOGY, else the
cost model's defaults), with the run's placement, dedup and chunks, among those its engine builds and its
memory holds. Every rank works it out from the same inputs (a fixed sampling seed) before any process group
exists, so all take the same; rank 0 says which it took and why, in one line."""
from __future__ import annotations

from dataclasses import replace

import torch

from dist_moe.train.precision import run_precision
from placement import Topology
from placement.forecast import ModelShape
from placement.layouts import price_layouts

TFLOPS = {"cuda": 400.0, "cpu": 0.1}  # achieved per rank by the experts' matmuls, as plan assumes


def moe_shape(cfg, device: str = "cuda") -> ModelShape:
    """The shape ``dist-moe plan`` prices: each MoE layer's hidden and expert sizes, the tokens a rank routes
    per step, the MoE layers, the dtype rows travel in (``parallel.wire_dtype``; auto: ``train.precision`` as
    it resolves on ``device``: plan prices a GPU cluster)."""
    m, r, d = cfg.model, cfg.router, cfg.data
    wire = cfg.parallel.wire_dtype
    if wire == "auto":  # the compute dtype
        wire = run_precision(cfg.train.precision, torch.device(device), cfg.train.gar is not None)
    if m.kind == "hf":
        from dist_moe.models.hf_config import EXPERT_COUNTS
        from dist_moe.models.hf_model import load_config, model_folder

        c = load_config(model_folder(m.path))
        experts = next(getattr(c, k) for k in EXPERT_COUNTS if getattr(c, k, None) is not None)
        ffn = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        return ModelShape(c.hidden_size, ffn, experts, c.num_experts_per_tok, cfg.train.batch_size * d.seq_len,
                          c.num_hidden_layers, wire)
    hidden = {"lm": m.d_model, "text": 384}.get(m.kind, m.d_model) or _features(d.name)
    per_row = d.seq_len if m.kind in ("lm", "text") else 1
    top_k = getattr(r, "top_k", None) or r.num_experts  # a dense router (SpecDrop) reaches every expert
    return ModelShape(hidden, m.ffn_hidden_size, r.num_experts, top_k, cfg.train.batch_size * per_row,
                      m.layers if m.kind == "lm" else 1, wire)


def _features(name: str) -> int:
    """A table's feature count (model.d_model 0: the MoE layer reads the features themselves)."""
    from dist_moe.data.tabular import load_keel

    return int(load_keel(name)[0].shape[1])


def choose_layout(cfg, topology: Topology, memory_bytes: float, device: str = "cpu"):
    """(``cfg`` with ``parallel.ep_size`` and ``ep_layout`` set to the fastest layout, the line that says so)."""
    parallel = cfg.parallel
    if parallel.placement.endswith((".yaml", ".yml")):
        raise ValueError(f"parallel.ep_size=auto with parallel.placement={parallel.placement!r}: a placement file "
                         "fixes the group size (its world_size); give parallel.ep_size")
    chunks = (1, 2, 4) if parallel.pipeline_chunks == "auto" else (parallel.start_chunks,)
    plan = price_layouts(moe_shape(cfg, device), topology, None, TFLOPS[device], None, chunks, memory_bytes)
    # the engines build groups of consecutive ranks; the run keeps its own placement, dedup and chunks
    layouts = [r for r in plan["layouts"] if cfg.engine == "torch" or r["layout"] == "contiguous"]
    priced = sorted(((_step(r, parallel), r) for r in layouts), key=lambda pr: (not pr[1]["fits"], pr[0]))
    # none fits: the layout whose ranks hold the fewest experts, the fastest of those (it may still fit:
    # the memory counted is an estimate)
    step, best = priced[0] if priced[0][1]["fits"] else min(priced, key=lambda pr: (pr[1]["memory_bytes"], pr[0]))
    others = ", ".join([f"EP {r['ep']} {r['layout']} {1e3 * s:.3g} ms" for s, r in priced if r is not best][:3])
    why = (f"the fastest of {len(priced)} layouts" if best["fits"] else
           f"none of {len(priced)} layouts fits this rank's memory: the one holding the fewest experts a rank")
    said = (f"parallel.ep_size=auto: EP {best['ep']} x {best['replicas']} replicas ({best['layout']}, groups "
            f"{best['group']}) predicted at {1e3 * step:.3g} ms per step, {why} on {topology.describe()}"
            + (f" (next: {others})" if others else "") + "; dist-moe plan prices them")
    return replace(cfg, parallel=replace(parallel, ep_size=best["ep"], ep_layout=best["layout"])), said


def _step(layout: dict, parallel) -> float:
    """A layout's step with the run's placement, dedup and chunks (its fastest such row)."""
    rows = [r for r in layout["rows"] if r["dedup"] == parallel.dedup and r["placement"] == parallel.placement]
    rows = rows or [r for r in layout["rows"] if r["dedup"] == parallel.dedup] or layout["rows"]
    return min(r["step_seconds"] for r in rows) + layout["grad_seconds"] + layout["dense_seconds"]

