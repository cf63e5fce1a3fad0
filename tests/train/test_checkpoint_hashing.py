"""A checkpoint save hashes each file on the rank that wrote it, never a peer's: rank 0 only gathers
the (name, size, SHA-256) of the others' shards for the manifest, so no rank waits in a collective
while another hashes the whole checkpoint. Checked on every rank of a 2-rank save, by recording
which files each rank's SHA-256 reads."""
import json
import os

import torch

from dist_moe import MoELayer
from dist_moe.train.checkpoint import store as checkpoint
from placement import Placement
from tests.support.dist_utils import run_workers

H, F, E = 6, 8, 8


def _save_worker(rank, world, directory):
    import torch.distributed as dist

    from dist_moe.train.checkpoint import files as checkpoint_files

    hashed = []
    real = checkpoint_files._sha256

    def recording(f):
        hashed.append(os.path.basename(os.readlink(f"/proc/self/fd/{f.fileno()}")))
        return real(f)

    checkpoint_files._sha256 = recording
    torch.manual_seed(0)
    layer = MoELayer(H, F, {"type": "switch", "num_experts": E, "top_k": 2}, placement=Placement.contiguous(E, world),
                     group=dist.group.WORLD)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
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

    from dist_moe.train.checkpoint import files as checkpoint_files

    real = checkpoint_files.hash_files

    def unreadable_on_rank1(path, names):
        if rank == 1:
            raise OSError(5, "Input/output error", str(path / names[0]))
        return real(path, names)

    checkpoint.hash_files = unreadable_on_rank1
    torch.manual_seed(0)
    layer = MoELayer(H, F, {"type": "switch", "num_experts": E, "top_k": 2}, placement=Placement.contiguous(E, world),
                     group=dist.group.WORLD)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    with pytest.raises(OSError if rank == 1 else checkpoint.CheckpointError, match="Input/output error") as e:
        checkpoint.save(directory, 3, layer, opt, {}, group=dist.group.WORLD)
    if rank == 0:
        assert "rank 1 could not hash the files it wrote" in str(e.value)


def test_a_rank_that_cannot_hash_its_files_stops_every_rank(tmp_path):
    run_workers(_failing_worker, 2, args=(str(tmp_path / "ckpt"),), timeout=120)
    assert checkpoint.latest(tmp_path / "ckpt") is None  # nothing named: the failed save is never loaded
