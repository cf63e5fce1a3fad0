"""What a run records beside its metrics: bytes per topology level, the routing record for
``dist-moe report``, and the training position a checkpoint resumes from."""
from __future__ import annotations

from pathlib import Path

import torch

from dist_moe.dispatch.stats import all_gather_rows
from dist_moe.train import checkpoint
from placement.simulate import RoutingRecord, recorded_layers, routing_file


def measured_bytes(model, rt) -> dict:
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
def record_routing(out_dir: Path, model, data, rt) -> None:
    """routing.npz (and routing.layer<i>.npz) for `dist-moe report / place / simulate`: every
    validation token's experts and rank at each MoE layer; under dist-moe's expert parallelism also
    the bytes that forward sent, per topology level."""
    from dist_moe.routing.gar import moe_layers

    rows = torch.tensor_split(torch.arange(len(data.x_val)), rt.world)[rt.rank]
    layers = [m for m in model.modules() if hasattr(m, "gar_site")]  # every MoE layer, any host
    measured = rt.world > 1 and all(hasattr(m, "traffic") for m in layers)
    for m in layers if measured else ():
        m.reset_traffic()
    model.eval()
    model(data.x_val[rows], data.val_categories(rows))
    model.train()
    group = rt.group if rt.world > 1 else None
    for i, (layer, site) in enumerate(zip(layers, moe_layers(model))):
        dispatch = None
        if measured:
            levels = layer.traffic.by_level()
            total = rt.sum(torch.tensor(list(levels.values()), dtype=torch.float64)).tolist()
            dispatch = {"topology": layer.topology.describe(), "expert_to_rank": layer.placement.expert_to_rank,
                        "dedup": layer.dedup, "measured_bytes_by_level": dict(zip(levels, map(int, total)))}
            layer.reset_traffic()
        idx = layer.last_routing.expert_idx
        idx_all = all_gather_rows(idx, group)
        src = all_gather_rows(torch.full((idx.shape[0],), rt.rank, dtype=torch.long), group)
        if rt.is_main:
            record = RoutingRecord(idx_all, src, site.router.num_experts, rt.world, layer.hidden_size * 4, dispatch)
            record.save(out_dir, i)
    if rt.is_main:  # a previous run in this directory may have had more layers
        for stale in range(len(layers), recorded_layers(out_dir)):
            for suffix in (".npz", ".json"):
                Path(out_dir, routing_file(stale)).with_suffix(suffix).unlink(missing_ok=True)


def position(step: int, epoch_gen: torch.Tensor, rt) -> dict:
    """Where training stands, as tensors: the step, the data order, this rank's RNG."""
    return {"step": torch.tensor(step), "data.epoch_generator": epoch_gen,
            f"rng.world{rt.world}.rank{rt.rank}": torch.get_rng_state()}


def resume(path: Path, model, opt, gen: torch.Generator, rt) -> int:
    """Load ``path`` into the model and optimizer, rewind the data order; returns the step."""
    extra = position(0, gen.get_state(), rt)
    loaded = checkpoint.load(path, model, opt, extra, rt.group if rt.world > 1 else None)
    if "step" not in loaded or "data.epoch_generator" not in loaded:
        raise ValueError(f"checkpoint {path} has no training position (step, data order)")
    gen.set_state(loaded["data.epoch_generator"])
    rng = f"rng.world{rt.world}.rank{rt.rank}"
    if rng in loaded:  # the same world size: every rank continues its own random stream
        torch.set_rng_state(loaded[rng])
    return int(loaded["step"])


