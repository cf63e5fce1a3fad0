"""parallel.pipeline_chunks: auto measures the candidates over the first steps where a node
boundary is crossed, keeps the fastest (fewer chunks within the tolerance), and agrees on every rank."""
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from dist_moe.train import chunk_tuning
from dist_moe.train.chunk_tuning import CANDIDATES, STEPS_EACH, ChunkTuner, fastest
from dist_moe.train.config import load_config
from tests.support.dist_utils import run_cases


def test_fastest_prefers_fewer_chunks_within_the_tolerance():
    assert fastest({1: 1.0, 2: 0.90, 4: 0.80}) == 4
    assert fastest({1: 1.0, 2: 0.98, 4: 0.99}) == 1  # 2% faster is within 3%: one chunk, fewer collectives
    assert fastest({1: 1.0, 2: 0.95, 4: 0.96}) == 2


class _Hosts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(1, 1), nn.Linear(1, 1)
        self.a.pipeline_chunks = self.b.pipeline_chunks = 7


def test_the_tuner_tries_each_candidate_and_keeps_the_fastest(monkeypatch):
    model = _Hosts()
    per_step = {1: 0.30, 2: 0.20, 4: 0.25}  # seconds a step takes with that many chunks
    clock = [0.0]
    monkeypatch.setattr(chunk_tuning.time, "perf_counter", lambda: clock[0])
    tuner = ChunkTuner(model, True, torch.device("cpu"), None)
    seen = []
    while tuner.tuning:
        tuner.before_step()
        seen.append(model.a.pipeline_chunks)
        assert model.b.pipeline_chunks == model.a.pipeline_chunks
        clock[0] += per_step[model.a.pipeline_chunks] * (3 if len(seen) % STEPS_EACH == 1 else 1)  # slow firsts
        tuner.after_step()
    assert seen == [c for c in CANDIDATES for _ in range(STEPS_EACH)]
    assert tuner.chosen == 2 and model.a.pipeline_chunks == model.b.pipeline_chunks == 2
    for c, t in per_step.items():  # each candidate's first step untimed, the others timed
        assert tuner.times[c] == pytest.approx([t] * (STEPS_EACH - 1)), c
    assert tuner.medians == pytest.approx(per_step)
    assert tuner.summary() == "parallel.pipeline_chunks auto: C=1 300 ms, C=2 200 ms, C=4 250 ms per step -> 2"
    tuner.before_step(), tuner.after_step()  # afterwards: nothing moves
    assert model.a.pipeline_chunks == 2


def test_without_a_node_boundary_nothing_is_measured():
    model = _Hosts()
    tuner = ChunkTuner(model, False, torch.device("cpu"), None)
    assert not tuner.tuning and tuner.chosen == 1 and model.a.pipeline_chunks == 1


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pipeline_chunks=fast"], "parallel.pipeline_chunks"),
    (["parallel.pipeline_chunks=auto", "train.deterministic=true"], "a deterministic run"),
])
def test_auto_config_errors_name_the_value(overrides, message):
    with pytest.raises(ValueError, match=message) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)
    if "fast" in overrides[0]:
        assert "'fast'" in str(e.value) and "auto" in str(e.value)


def _auto_worker(rank, world, topology, out_dir, data_dir):
    os.environ["DIST_MOE_DATA"] = data_dir
    if topology:  # what a launcher's ranks see
        os.environ.update(DIST_MOE_TOPOLOGY=topology, WORLD_SIZE=str(world))
    else:  # not launched: one node
        for key in ("DIST_MOE_TOPOLOGY", "WORLD_SIZE"):
            os.environ.pop(key, None)
    from dist_moe.train.trainer import train

    summary = train(load_config(None, ["data.max_rows=1500", "train.max_steps=12", "train.batch_size=64",
                                       "parallel.pipeline_chunks=auto", f"output.dir={out_dir}"]), quiet=True)
    Path(out_dir, f"summary.rank{rank}.json").write_text(json.dumps(summary))


def test_auto_measures_across_nodes_and_agrees_on_every_rank(tmp_path):
    data = str(tmp_path / "data")
    across, one_node = tmp_path / "across", tmp_path / "one_node"
    run_cases(2, [(_auto_worker, "node=2,gpu=1", str(across), data), (_auto_worker, "", str(one_node), data)],
              timeout=240)
    for rank in range(2):
        s = json.loads((across / f"summary.rank{rank}.json").read_text())
        assert s["steps"] == 12 and s["topology"].startswith("node=2")
        assert set(s["pipeline_chunks_measured_s"]) == {str(c) for c in CANDIDATES}, (rank, s)
        assert s["pipeline_chunks"] == fastest({int(c): t for c, t in s["pipeline_chunks_measured_s"].items()})
        s1 = json.loads((one_node / f"summary.rank{rank}.json").read_text())
        assert s1["pipeline_chunks"] == 1 and "pipeline_chunks_measured_s" not in s1, (rank, s1)
    chosen = {json.loads((across / f"summary.rank{r}.json").read_text())["pipeline_chunks"] for r in range(2)}
    assert len(chosen) == 1  # every rank keeps the same count
