"""``dist-moe train`` on a transformers MoE model over several ranks equals the same run in one process.

A tiny DeepSeek-V3 (group-limited: ``n_group`` = 2 nodes, ``topk_group`` = 1), launched as a user
launches it: 4 ranks as 2 nodes x 2, in expert-parallel groups of 2 strided over the nodes (replicas side
by side), with node dedup and 3 pipelined chunks for two steps, checkpointed, then resumed on 2 ranks (one
group: the world) under another placement (round robin) for two more. Every step's loss equals
the one-process run's with the same global batch, and the trained model each writes
(``output.dir/hf_model``, gathered from every rank's experts) equals it, to 1e-5.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_moe.cli import main
from tests.support.dist_utils import free_port
from tests.support.hf_models import model_folder, text

pytest.importorskip("transformers", reason="transformers is not installed")

ROOT = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 8


def _args(tmp_path, out: str, world: int, steps: int, *more) -> list[str]:
    return ["model.kind=hf", f"model.path={tmp_path / 'model'}", f"data.name={tmp_path / 'text.txt'}",
            "data.seq_len=16", f"train.batch_size={GLOBAL_BATCH // world}", f"train.max_steps={steps}",
            "train.log_every=1", "train.lr=3e-3", f"output.dir={tmp_path / out}", *more]


def _torchrun(tmp_path, world: int, topology: str, args: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIST_MOE_TOPOLOGY": topology, "DIST_MOE_DATA": str(tmp_path / "data")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "dist_moe.cli", "train", "--quiet", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:]


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "hf_model" / "model.safetensors")


def test_four_ranks_then_two_resumed_train_the_model_as_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path / "data"))
    (tmp_path / "text.txt").write_text(text(120))
    model_folder(tmp_path / "model", "deepseek_v3", weights=True, nodes=2)
    assert main(["train", "--quiet", *_args(tmp_path, "one", 1, 4)]) == 0
    _torchrun(tmp_path, 4, "node=2,gpu=2", _args(tmp_path, "many", 4, 2, "parallel.dedup=node",
                                                 "parallel.pipeline_chunks=3", "train.checkpoint_every=2",
                                                 "parallel.ep_size=2", "parallel.ep_layout=strided"))
    first = _losses(tmp_path / "many")
    _torchrun(tmp_path, 2, "node=1,gpu=2", _args(tmp_path, "many", 2, 4, "parallel.placement=round_robin",
                                                 "train.checkpoint_every=2", "train.resume=true"))
    one, many = _losses(tmp_path / "one"), {**first, **_losses(tmp_path / "many")}
    assert sorted(many) == sorted(one) == [1, 2, 3, 4]
    for step in one:
        assert abs(many[step] - one[step]) < 1e-5, (step, many[step], one[step])
    want, got = _weights(tmp_path / "one"), _weights(tmp_path / "many")
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, atol=1e-5, rtol=1e-5, msg=name)
    summary = json.loads((tmp_path / "many" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
