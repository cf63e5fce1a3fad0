"""A run that saves or resumes checkpoints on several ranks first checks that every rank sees its checkpoint
folder as rank 0 does: a folder on each node's own disk would leave every save incomplete. Rank 1 is made to
see another folder (a node-local disk) by handing it another path, or, inside a training run, by reading the
marker from another folder."""
from pathlib import Path
from types import SimpleNamespace

import pytest

from dist_moe.train.checkpoint import store as checkpoint
from tests.support.dist_utils import run_cases

SAVES = SimpleNamespace(checkpoint_every=10, resume=False)
RESUMES = SimpleNamespace(checkpoint_every=None, resume=True)
NEITHER = SimpleNamespace(checkpoint_every=None, resume=False)


def _not_shared_line(folder, world=2) -> str:
    return (f"checkpoint folder {folder} is not shared by every node: checkpoints need a file system every node sees "
            f"(rank 1 of {world} cannot see the file rank 0 wrote there)")


def _shared(rank, world, tmp):
    import torch.distributed as dist

    folder = Path(tmp) / "run" / "checkpoints"  # not there yet: rank 0 makes it for the check, then removes it
    for train in (SAVES, RESUMES):
        checkpoint.check_shared(folder, train, dist.group.WORLD)
        dist.barrier()
        assert not folder.exists()
        dist.barrier()  # every rank has looked before one makes it below
    folder.mkdir(parents=True, exist_ok=True)  # there already (a resumed run's): kept, and no marker left in it
    dist.barrier()
    checkpoint.check_shared(folder, SAVES, dist.group.WORLD)
    dist.barrier()
    assert list(folder.iterdir()) == []


def _not_shared(rank, world, tmp):
    import torch.distributed as dist

    folder = Path(tmp) / ("run" if rank == 0 else f"node{rank}-disk") / "checkpoints"
    for train in (SAVES, RESUMES):
        with pytest.raises(ValueError) as e:
            checkpoint.check_shared(folder, train, dist.group.WORLD)
        assert str(e.value) == _not_shared_line(Path(tmp) / "run" / "checkpoints"), e.value  # the same on every rank
    checkpoint.check_shared(folder, NEITHER, dist.group.WORLD)  # nothing saved or read: nothing to share


def test_every_rank_sees_a_shared_checkpoint_folder_and_a_node_local_one_is_refused_on_every_rank(tmp_path):
    run_cases(2, [(_shared, str(tmp_path / "a")), (_not_shared, str(tmp_path / "b"))], timeout=120)


def _training_worker(rank, world, out, data):
    import os

    from dist_moe.train.config import load_config
    from dist_moe.train.trainer import train

    os.environ["DIST_MOE_DATA"] = data
    if rank == 1:  # this rank's node has a folder of its own at the same path
        real = checkpoint._read_mark
        checkpoint._read_mark = lambda path, *a: real(path.parents[2] / "node1-disk" / path.name, *a)
    cfg = load_config(None, ["data.max_rows=300", "train.max_steps=2", "train.checkpoint_every=1",
                             f"output.dir={out}/run"])
    with pytest.raises(ValueError) as e:
        train(cfg, quiet=True)
    assert str(e.value) == _not_shared_line(f"{out}/run/checkpoints"), e.value


def test_a_training_run_stops_before_its_first_step_when_a_rank_cannot_see_its_checkpoints(tmp_path):
    run_cases(2, [(_training_worker, str(tmp_path), str(tmp_path / "data"))], timeout=180)
    assert not (tmp_path / "run").exists()  # nothing left behind: the run stopped before its first step


def test_the_line_names_the_ranks_that_cannot_see_the_folder():
    assert str(checkpoint.not_shared("/x", list(range(8, 16)), 16)).endswith(
        "(ranks 8, 9, 10, 11 and 4 more of 16 cannot see the file rank 0 wrote there)")
    assert str(checkpoint.not_shared("/x", [1], 2)) == _not_shared_line("/x")
