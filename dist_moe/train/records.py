"""What a run records beside its metrics: the routing record for ``dist-moe report``, and the
training position a checkpoint resumes from."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from dist_moe.dispatch.stats import all_gather_rows
from dist_moe.moe_view import moe_layers
from dist_moe.train import checkpoint
from placement.simulate import RoutingRecord, recorded_layers, routing_file


@torch.no_grad()
def record_routing(out_dir: Path, model, data, rt) -> None:
    """routing.npz (and routing.layer<i>.npz) for `dist-moe report / place / simulate`: every
    validation token's experts and rank at each MoE layer; under dist-moe's expert parallelism also
    the bytes that forward sent, per topology level."""
    rows = torch.tensor_split(torch.arange(len(data.x_val)), rt.world)[rt.rank]
    layers = moe_layers(model)  # every MoE layer, any host
    measured = rt.world > 1 and all(hasattr(m, "traffic") for m in layers)
    for m in layers if measured else ():
        m.reset_traffic()
    model.eval()
    device = next(model.parameters()).device
    cats = data.val_categories(rows)
    model(data.x_val[rows].to(device), None if cats is None else cats.to(device))
    model.train()
    group = rt.group if rt.world > 1 else None
    for i, layer in enumerate(layers):
        dispatch = None
        if measured:
            levels = layer.traffic.by_level()
            total = rt.sum(torch.tensor(list(levels.values()), dtype=torch.float64)).tolist()
            dispatch = {"topology": layer.topology.describe(), "expert_to_rank": layer.placement.expert_to_rank,
                        "dedup": layer.dedup, "measured_bytes_by_level": dict(zip(levels, map(int, total)))}
            layer.reset_traffic()
        idx = layer.last_routing.expert_idx.cpu()
        idx_all = all_gather_rows(idx, group)
        probs = all_gather_rows(layer.last_routing.probs.float().cpu(), group)  # replays other limits later
        src = all_gather_rows(torch.full((idx.shape[0],), rt.rank, dtype=torch.long), group)
        if rt.is_main:
            record = RoutingRecord(idx_all, src, layer.router.num_experts, rt.world, layer.hidden_size * 4, dispatch,
                                   probs)
            record.save(out_dir, i)
    if rt.is_main:  # a previous run in this directory may have had more layers
        for stale in range(len(layers), recorded_layers(out_dir)):
            for suffix in (".npz", ".json"):
                Path(out_dir, routing_file(stale)).with_suffix(suffix).unlink(missing_ok=True)


class DataCursor:
    """The training data order and where training stands in it, in samples.

    Epoch e's order is a permutation drawn from one seeded generator (the same on every
    rank; each rank takes its share of every global batch). The position is the number of
    samples consumed, as Megatron's consumed_samples, not a step count: steps per epoch
    depend on the world size, samples do not, so a run resumed on another number of ranks
    trains exactly the samples that remain (global batches of the new world from there).
    """

    def __init__(self, num_samples: int, seed: int, global_batch: int):
        self.n, self.global_batch = num_samples, global_batch
        self.gen = torch.Generator().manual_seed(seed)
        self.consumed = 0
        self._perm, self._epoch_start = None, None

    @property
    def epoch(self) -> int:
        return self.consumed // self.n

    @property
    def offset(self) -> int:
        return self.consumed % self.n

    def next_batch(self) -> torch.Tensor:
        """The next global batch's row ids (short at an epoch's end); advances the position."""
        if self._perm is None:  # the first batch of this position's epoch draws its order
            self._epoch_start = self.gen.get_state()
            self._perm = torch.randperm(self.n, generator=self.gen)
        rows = self._perm[self.offset : self.offset + self.global_batch]
        self.consumed += len(rows)
        if self.offset == 0:  # the epoch is done: the next batch draws the next order
            self._perm = None
        return rows

    def steps_left(self, total_samples: int) -> int:
        """Optimizer steps from here to ``total_samples`` at this world's global batch."""
        if self.consumed >= total_samples:
            return 0
        whole, rest = divmod(total_samples - self.consumed - (self.n - self.offset) % self.n, self.n)
        first = math.ceil(((self.n - self.offset) % self.n) / self.global_batch)
        return first + whole * math.ceil(self.n / self.global_batch) + math.ceil(rest / self.global_batch)

    def state(self) -> dict:
        """Tensors a checkpoint saves: samples consumed and the generator at that epoch's start."""
        gen = self.gen.get_state() if self._perm is None else self._epoch_start
        return {"data.samples": torch.tensor(self.consumed), "data.epoch_generator": gen}

    def load(self, state: dict) -> None:
        self.consumed = int(state["data.samples"])
        self.gen.set_state(state["data.epoch_generator"])
        self._perm = None


def position(step: int, cursor: DataCursor, rt) -> dict:
    """Where training stands, as tensors: the step, the data position, this rank's RNG streams (the
    CPU's, and its GPU's on a CUDA run: Switch's jitter draws there)."""
    out = {"step": torch.tensor(step), **cursor.state(), f"rng.world{rt.world}.rank{rt.rank}": torch.get_rng_state()}
    if rt.device.type == "cuda":
        out[f"cuda_rng.world{rt.world}.rank{rt.rank}"] = torch.cuda.get_rng_state(rt.device)
    return out


def resume(path: Path, model, opt, cursor: DataCursor, rt) -> int:
    """Load ``path`` into the model and optimizer and the cursor's position; returns the step."""
    extra = position(0, cursor, rt)
    loaded = checkpoint.load(path, model, opt, extra, rt.group if rt.world > 1 else None)
    if "step" not in loaded or "data.epoch_generator" not in loaded:
        raise ValueError(f"checkpoint {path} has no training position (step, data order)")
    if "data.samples" not in loaded:  # written before positions were kept in samples: steps of this world
        steps = math.ceil(cursor.n / cursor.global_batch)
        epoch, batch = divmod(int(loaded["step"]), steps)
        loaded["data.samples"] = torch.tensor(epoch * cursor.n + batch * cursor.global_batch)
    for key in ("step", "data.samples"):  # counts: a forged -10**15 would be reported as samples trained
        if not 0 <= int(loaded[key]) < 2**62:
            raise checkpoint.CheckpointError(f"checkpoint {path}: {key} is {int(loaded[key])}, not a count in "
                                             "[0, 2**62)")
    rng = f"rng.world{rt.world}.rank{rt.rank}"
    try:  # the generators check a state's size and contents themselves
        cursor.load(loaded)
        if rng in loaded:  # the same world size: every rank continues its own random stream
            torch.set_rng_state(loaded[rng])
        if f"cuda_{rng}" in loaded:
            torch.cuda.set_rng_state(loaded[f"cuda_{rng}"], rt.device)
    except RuntimeError as e:
        raise checkpoint.CheckpointError(f"checkpoint {path}: a saved random-generator state is not valid "
                                         f"({str(e)[:200]})") from None
    return int(loaded["step"])


