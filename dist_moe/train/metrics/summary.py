"""summary.json: what a run was (its name, router, engine, world and layout), how far it trained, how long
it took, its chunk count and its last validation metrics. Written last, by the main rank, once training
ends: a run directory without it stopped before its end (``trainer.trained_and_exported``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dist_moe.train.metrics.log import json_safe, reduced
from dist_moe.train.run_config import output_dir
from placement import random_pair_tree_distance, write_atomic

if TYPE_CHECKING:
    from dist_moe.train.chunk_tuning import ChunkTuner
    from dist_moe.train.run_config import RunConfig
    from dist_moe.train.runtime import Runtime

SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class Trained:
    """How far a run trained, how long it took (as this rank counted it) and its last validation metrics."""

    steps: int
    already_finished: bool  # resumed from a checkpoint with nothing left to train
    samples: int  # consumed since the run began, resumes included
    samples_this_run: int
    skipped_steps: int
    seconds: float  # since this process started the run
    train_seconds: float  # inside training steps only
    exchange_wait_s: float  # of those, waiting in the dispatcher's exchanges
    last_eval: dict  # the last validation pass's metrics (val_loss, ...)


def write_summary(cfg: RunConfig, rt: Runtime, out_dir: Path, trained: Trained, tuner: ChunkTuner, first_layer,
                  hf_model: Path | None, extra: dict) -> dict:
    """summary.json's mapping, written by the main rank into ``out_dir``; every rank calls it (the exchange
    waits are summed over the ranks). ``first_layer``: the model's first MoE layer; ``hf_model``: where
    model.kind hf's trained model will be (None: no export); ``extra``: fields of an experiment's ``after``
    hook, last. It names the run's output.dir, where an output.overwrite run's ``out_dir`` goes once done."""
    chunks = cfg.parallel.pipeline_chunks
    own = cfg.router is None  # model.kind hf: the model's own router, by its class name, and what it routes to
    summary = json_safe({
        "name": cfg.name, "router": first_layer.router.name if own else cfg.router.type,
        **({"num_experts": first_layer.num_experts, "top_k": _top_k(first_layer)} if own else {}),
        "engine": rt.engine.name, "world_size": rt.world, "ep_size": rt.ep_size,
        **({"ep_layout": rt.layout.layout} if rt.layout.replicas > 1 else {}),
        "topology": rt.topology().describe(),
        "steps": trained.steps, "already_finished": trained.already_finished, "samples": trained.samples,
        "samples_this_run": trained.samples_this_run,
        "skipped_steps": trained.skipped_steps, "seconds": round(trained.seconds, 2),
        "train_seconds": round(trained.train_seconds, 3),
        "exchange_wait_s": round(reduced({"w": trained.exchange_wait_s}, torch.zeros(0), rt)[0]["w"], 3),
        # auto: what the first steps measured (null if the run ended before) and the seconds per step
        "pipeline_chunks": tuner.chosen if chunks == "auto" else chunks,
        **({"pipeline_chunks_measured_s": {str(c): round(t, 4) for c, t in tuner.medians.items()}}
           if tuner.medians else {}),
        **trained.last_eval,
        # the baseline of BRANCH's tree distance: a tree of dist-moe's experts, not a model's own router's
        "random_pair_tree_distance": None if own else _random_pair(first_layer.num_experts),
        "output_dir": str(output_dir(cfg)),
        **({"hf_model": str(hf_model)} if hf_model is not None else {}),
        **extra,
    })
    if rt.is_main:
        write_atomic(out_dir / SUMMARY_FILE, json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return summary


def _top_k(layer) -> int | None:
    """The experts each token chose in the layer's last routing (None before any)."""
    routing = getattr(layer, "last_routing", None)
    return None if routing is None else int(routing.expert_idx.shape[1])


def _random_pair(num_experts: int) -> float | None:
    """The tree distance of two experts drawn at random: the baseline a router's co-selections are read
    against (a power-of-two expert count only: the tree's)."""
    return random_pair_tree_distance(num_experts) if num_experts >= 2 and not num_experts & (num_experts - 1) else None
