"""A checkpoint resumed on another number of ranks trains exactly the samples that remain.

The position is kept in samples consumed (and the epoch's permutation state), not in steps,
whose count per epoch depends on the world size."""
import shutil

import pytest
import torch

from dist_moe.train.checkpoint.state import DataCursor
from tests.support.dist_utils import run_workers

pytestmark = pytest.mark.slow  # two resumed runs per case: 10-15 s each in one process

N, EPOCHS, BATCH = 400, 2, 32  # training rows (data.max_rows=500, 20% held out), per-rank batch


def _order(cursor: DataCursor, until: int) -> tuple[list[int], int]:
    """The sample ids the cursor hands out up to ``until`` samples, and how many batches."""
    rows, batches = [], 0
    while cursor.consumed < until:
        rows += cursor.next_batch().tolist()
        batches += 1
    return rows, batches


@pytest.mark.parametrize("before,after", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4)])
@pytest.mark.parametrize("stop", [0.05, 0.45, 0.5, 0.8])
def test_a_resumed_cursor_continues_the_same_sample_order(before, after, stop):
    whole, total_batches = _order(DataCursor(N, 0, BATCH * before), EPOCHS * N)
    stop_batches = max(1, int(stop * total_batches))  # mid-epoch, and at the end of the first epoch
    first = DataCursor(N, 0, BATCH * before)
    head = [r for _ in range(stop_batches) for r in first.next_batch().tolist()]
    resumed = DataCursor(N, 0, BATCH * after)
    resumed.load({k: v.clone() for k, v in first.state().items()})
    steps = resumed.steps_left(EPOCHS * N)
    tail, batches = _order(resumed, EPOCHS * N)
    assert head + tail == whole  # every sample once per epoch, in the uninterrupted order
    assert steps == batches


def _train(rank, world, out, overrides, result):
    import json

    from dist_moe.train.config import load_config
    from dist_moe.train.trainer import train

    cfg = load_config(None, ["data.max_rows=500", f"train.batch_size={BATCH}", f"train.epochs={EPOCHS}",
                             "router.num_experts=8", "router.top_k=2", "train.checkpoint_every=3",
                             f"output.dir={out}", *overrides])
    summary = train(cfg, quiet=True)
    if rank == 0:
        with open(result, "w") as f:
            json.dump(summary, f)


def _run(world, out, tmp_path, *overrides) -> dict:
    import json

    result = tmp_path / f"summary-{world}.json"
    run_workers(_train, world, args=(str(out), list(overrides), str(result)), timeout=240)
    return json.loads(result.read_text())


def _rewind(ckpts, step: int) -> None:
    """Keep checkpoints up to ``step`` and point ``latest`` at it (as if the run had died there)."""
    for d in ckpts.glob("step-*"):
        if int(d.name.split("-")[1]) > step:
            shutil.rmtree(d)
    (ckpts / "latest").write_text(f"step-{step}\n")


@pytest.mark.parametrize("before,afters", [(2, (1, 4)), (4, (2,))])  # 1 -> 2: the cursor test above
def test_resuming_on_another_world_trains_exactly_the_remaining_samples(tmp_path, before, afters):
    out = tmp_path / "run"
    full = _run(before, out, tmp_path)
    assert full["samples"] == EPOCHS * N and full["samples_this_run"] == EPOCHS * N
    _rewind(out / "checkpoints", 3)  # 3 steps of `before` ranks done, as if the run had died there
    done = 3 * BATCH * before
    for after in afters:
        copy = tmp_path / f"resumed-on-{after}"
        shutil.copytree(out, copy)
        resumed = _run(after, copy, tmp_path, "train.resume=true")
        assert resumed["samples"] == EPOCHS * N, after
        assert resumed["samples_this_run"] == EPOCHS * N - done, after
        cursor = DataCursor(N, 0, BATCH * after)
        cursor.consumed = done
        assert resumed["steps"] == 3 + cursor.steps_left(EPOCHS * N), after
        assert torch.isfinite(torch.tensor(resumed["val_loss"]))
