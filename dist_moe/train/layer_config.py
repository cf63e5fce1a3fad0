"""A training run's MoE layers from its config, in one place: every ``MoELayerConfig`` field, its exchange
included, comes from a key of the run config (``model``, ``parallel``, ``train.deterministic``); the layer's
width and its router come from the model being built and its data."""
from __future__ import annotations

import datetime

from dist_moe.dispatch.exchange import ExchangeConfig
from dist_moe.moe.layer import MoELayerConfig
from dist_moe.routing.registry import RouterConfig
from dist_moe.train.run_config import ParallelConfig, RunConfig


def exchange_config(parallel: ParallelConfig, deterministic: bool) -> ExchangeConfig:
    """How a run's MoE layers exchange their tokens where dist-moe's dispatcher moves them (``parallel``,
    ``train.deterministic``); an auto chunk count starts at 1 until measured."""
    return ExchangeConfig(parallel.dedup, parallel.start_chunks, deterministic,
                          datetime.timedelta(seconds=parallel.timeout_s), parallel.wire_dtype)


def layer_config(cfg: RunConfig, hidden: int, router: RouterConfig | dict) -> MoELayerConfig:
    """One MoE layer of ``cfg``: ``hidden`` wide (the model's width), routed by ``router`` (the run's router
    config, with what its data gives it: SpecDrop's categories)."""
    model = cfg.model
    return MoELayerConfig(hidden, model.ffn_hidden_size, router, model.capacity_factor,
                          shared_expert_hidden=model.shared_expert_hidden, expert_type=model.expert_type,
                          lora_rank=model.lora_rank, lora_alpha=model.lora_alpha,
                          exchange=exchange_config(cfg.parallel, cfg.train.deterministic))
