"""A checkpoint save hashes each file on the rank that wrote it, never a peer's: rank 0 only gathers
the (name, size, SHA-256) of the others' shards for the manifest. Checked on every rank of a 2-rank save,
by recording which files each rank's hashing opens. A rank that hashes slowly holds the others in short
collectives only: the save outlasts the group's timeout and still succeeds."""
import datetime
import hashlib
import json
import math
import os
import time

import pytest
import torch

from dist_moe import MoELayer
from dist_moe.train.checkpoint import store as checkpoint
from placement import Placement
from tests.support.dist_utils import run_cases, run_workers

H, F, E = 6, 8, 8


def _layer_and_optimizer(world):
    """The expert-parallel layer and optimizer whose checkpoint the workers save, the same on every rank."""
    import torch.distributed as dist

    torch.manual_seed(0)
    layer = MoELayer(H, F, {"type": "switch", "num_experts": E, "top_k": 2}, placement=Placement.contiguous(E, world),
                     group=dist.group.WORLD)
    return layer, torch.optim.Adam(layer.parameters(), lr=1e-2)


def _save_worker(rank, world, directory):
    import torch.distributed as dist

    from dist_moe.train.checkpoint import hashing

    hashed = []
    real = hashing.open_regular

    def recording(path, *args):
        hashed.append(os.path.basename(path))
        return real(path, *args)

    hashing.open_regular = recording
    layer, opt = _layer_and_optimizer(world)
    checkpoint.save(directory, 3, layer, opt, {"step": torch.tensor(3)}, group=dist.group.WORLD,
                    config={"seed": 0})
    with open(f"{directory}/hashed-by-rank{rank}.json", "w") as f:
        json.dump(hashed, f)


def test_each_rank_hashes_only_the_files_it_wrote(tmp_path):
    directory = tmp_path / "ckpt"
    run_workers(_save_worker, 2, args=(str(directory),), timeout=120)
    path = checkpoint.latest(directory)
    checkpoint.verify(path)  # the gathered hashes make a manifest that holds
    listed = set(json.loads((path / checkpoint.MANIFEST).read_text())["files"])
    hashed = [json.loads((directory / f"hashed-by-rank{r}.json").read_text()) for r in range(2)]
    for rank in range(2):
        own = {n for n in listed if n.startswith(f"__{rank}_")}  # DCP names a rank's shards __<rank>_<i>.distcp
        own |= {".metadata", checkpoint.CONFIG} if rank == 0 else set()  # the coordinator's, and the run config
        assert sorted(hashed[rank]) == sorted(own), f"rank {rank} hashed {hashed[rank]}, it wrote {sorted(own)}"
    assert set(hashed[0]) | set(hashed[1]) == listed  # every file hashed once, by its writer
    assert any(n.startswith("__1_") for n in listed)  # rank 1 wrote a shard of its own: the check is not vacuous


def _failing_worker(rank, world, directory):
    import pytest
    import torch.distributed as dist

    from dist_moe.train.checkpoint import hashing

    real = hashing.open_regular

    def unreadable_on_rank1(path, *args):
        if rank == 1:
            raise OSError(5, "Input/output error", str(path))
        return real(path, *args)

    hashing.open_regular = unreadable_on_rank1
    layer, opt = _layer_and_optimizer(world)
    with pytest.raises(OSError if rank == 1 else checkpoint.CheckpointError, match="Input/output error") as e:
        checkpoint.save(directory, 3, layer, opt, {}, group=dist.group.WORLD)
    if rank == 0:
        assert "rank 1 could not hash the files it wrote" in str(e.value)


def test_a_rank_that_cannot_hash_its_files_stops_every_rank(tmp_path):
    run_workers(_failing_worker, 2, args=(str(tmp_path / "ckpt"),), timeout=120)
    assert checkpoint.latest(tmp_path / "ckpt") is None  # nothing named: the failed save is never loaded


TIMEOUT_S = 3  # the group's: every collective of the save must end within it
SLOW_S = 8  # rank 1's hash of its shard, far past the timeout
_REAL_SHA256 = hashlib.sha256


class _SlowSha256:
    """SHA-256 at about 1 MiB / SLOW_S: a large shard on a slow disk."""

    def __init__(self):
        self.h = _REAL_SHA256()

    def update(self, block):
        time.sleep(len(block) * SLOW_S / 2**20)
        self.h.update(block)

    def hexdigest(self):
        return self.h.hexdigest()


def _slow_hash_worker(rank, world, directory, slice_s):
    """Rank 1 hashes its 1 MiB shard for SLOW_S seconds on a group whose collectives time out after TIMEOUT_S."""
    import torch.distributed as dist

    import dist_moe.train.checkpoint.dcp  # noqa: F401  (imported by every rank before the timed collectives)
    from dist_moe.train.checkpoint import hashing

    hashing.BLOCK, hashing.SLICE_S = 64 << 10, slice_s
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    blob = {f"blob.rank{rank}": torch.ones(2**18)}  # 1 MiB a rank, in a shard of its own
    if rank == 1:
        hashlib.sha256 = _SlowSha256
    start = time.monotonic()
    try:
        if slice_s == math.inf:  # one slice: the ranks meet only once every hash is done, as a save did before
            with pytest.raises(RuntimeError) as e:
                checkpoint.save(directory, 1, model, opt, blob, group=group)
            assert rank == 1 or "Timed out" in str(e.value), e.value
        else:
            checkpoint.save(directory, 1, model, opt, blob, group=group)
            assert time.monotonic() - start > TIMEOUT_S + 2  # rank 0 waited past the timeout, in short collectives
    finally:
        hashlib.sha256 = _REAL_SHA256
        dist.destroy_process_group(group)


def test_a_slow_hash_on_one_rank_holds_the_others_in_short_collectives_only(tmp_path):
    """Rank 0 hashes at once and waits SLOW_S for rank 1, in all-reduces of a slice each: the save succeeds. With
    one slice for the whole hash (the save before), rank 0 waited in one collective and timed out."""
    run_cases(2, [(_slow_hash_worker, str(tmp_path / "sliced"), 0.5),
                  (_slow_hash_worker, str(tmp_path / "whole"), math.inf)], timeout=180)
    checkpoint.verify(checkpoint.latest(tmp_path / "sliced"))
    assert checkpoint.latest(tmp_path / "whole") is None
