"""The routing record a run writes beside its metrics, for ``dist-moe report / place / simulate``."""
from __future__ import annotations

from pathlib import Path

import torch

from dist_moe.distributed.reductions import all_gather_rows
from dist_moe.moe.view import bytes_counter, moe_layers
from dist_moe.train.metrics.evaluate import shared_rows
from placement.simulate import RoutingRecord, recorded_layers, routing_file


@torch.no_grad()
def record_routing(out_dir: Path, model, data, rt, max_rows: int | None = None) -> None:
    """routing.npz (and routing.layer<i>.npz) for `dist-moe report / place / simulate`: the experts and rank
    of every token of the validation rows a validation pass reads (the first ``max_rows``; None: all) at
    each MoE layer; under dist-moe's expert parallelism also the bytes those forwards sent, per topology
    level. With expert-parallel groups smaller than the world the record is of one group's layout (its
    topology, its ranks), every replica's tokens on it."""
    mine, batches = shared_rows(min(len(data.x_val), max_rows or len(data.x_val)), rt.world, rt.rank)
    layers = moe_layers(model)  # every MoE layer, any host
    counters = [bytes_counter(m) for m in layers]
    measured = rt.ep_size > 1 and all(c is not None for c in counters)
    for c in counters if measured else ():
        c.reset_traffic()
    model.eval()
    device = next(model.parameters()).device
    routed = [[] for _ in layers]  # per layer, each forward's (expert_idx, probs)
    for at in batches:
        rows = mine[at]
        cats = data.val_categories(rows)
        model(data.x_val[rows].to(device), None if cats is None else cats.to(device))
        for per_forward, layer in zip(routed, layers):
            per_forward.append((layer.last_routing.expert_idx.cpu(), layer.last_routing.probs.float().cpu()))
    model.train()
    group = rt.group if rt.world > 1 else None
    for i, layer in enumerate(layers):
        dispatch = None
        if measured:
            counter = counters[i]
            levels = counter.traffic.by_level()
            total = rt.sum(torch.tensor(list(levels.values()), dtype=torch.float64)).tolist()
            dispatch = {"topology": counter.topology.describe(), "expert_to_rank": counter.placement.expert_to_rank,
                        "dedup": counter.dedup, "measured_bytes_by_level": dict(zip(levels, map(int, total)))}
            counter.reset_traffic()
        idx = torch.cat([e for e, _ in routed[i]])
        idx_all = all_gather_rows(idx, group)
        probs = all_gather_rows(torch.cat([p for _, p in routed[i]]), group)  # replays other limits later
        # each token's rank in its expert-parallel group: every replica's tokens on the one layout they share
        src = all_gather_rows(torch.full((idx.shape[0],), rt.ep_rank, dtype=torch.long), group)
        if rt.is_main:  # a copy's bytes as its wire sent them (fp32 where nothing was exchanged)
            sent = counters[i].exchange.dispatcher.row_bytes if measured else None
            record = RoutingRecord(idx_all, src, layer.router.num_experts, rt.ep_size, sent or layer.hidden_size * 4,
                                   dispatch, probs)
            record.save(out_dir, i)
    if rt.is_main:  # a previous run in this directory may have had more layers
        for stale in range(len(layers), recorded_layers(out_dir)):
            for suffix in (".npz", ".json"):
                Path(out_dir, routing_file(stale)).with_suffix(suffix).unlink(missing_ok=True)
