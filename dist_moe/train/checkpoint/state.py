"""Where training stands, saved and restored together: the step, the data cursor, every rank's
random streams and the checkpoint of model and optimizer. The trainer calls ``save_state`` and
``restore_state``; both go through ``position`` and ``checkpoint``, one way each."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from dist_moe.train.checkpoint import store as checkpoint


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


def restore_state(path: Path, model, opt, cursor: DataCursor, rt) -> int:
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


def save_state(directory: Path, step: int, model, opt, cursor: DataCursor, rt, config: dict | None = None,
               keep: int | None = None) -> Path:
    """Checkpoint ``step-<step>`` under ``directory`` with this position (every rank calls it); the newest
    ``keep`` stay (None: all)."""
    return checkpoint.save(directory, step, model, opt, position(step, cursor, rt), rt.group if rt.world > 1 else None,
                           config=config, keep=keep)
