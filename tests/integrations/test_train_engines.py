"""`engine: torch | deepspeed | megatron`: the same training config on 2 CPU ranks with each host."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.dist_utils import run_cases

ROOT = Path(__file__).resolve().parents[2]
GAR = ["router.type=switch", "train.gar.lambda=0.001", "train.gar_group_size=16"]
GAR_PIPELINED = [*GAR, "parallel.pipeline_chunks=2"]  # factor captures per chunk
# the tiny LM with SpecDrop by domain: per-sequence categories through the hosted layers
LM = ["--config", "configs/lm_branch.yaml", "data.per_domain=150", "data.seq_len=32", "train.max_steps=25",
      "data.categories=domains", "router.type=specdrop", "router.num_categories=4", "router.p_assigned=0.7",
      "parallel.placement=contiguous"]
# Megatron's layer and experts with dist-moe's dispatcher, pipelined (parallel.dispatcher auto picks it)
MEGATRON_DIST_MOE = ["parallel.pipeline_chunks=2"]
# DeepSpeed's MoE module and experts under deepspeed.initialize, dist-moe's dispatcher, pipelined
DEEPSPEED_DIST_MOE = ["parallel.dispatcher=dist_moe", "parallel.pipeline_chunks=2"]
COMMON = ["data.max_rows=3000", "train.epochs=3", "train.batch_size=64", "train.log_every=5", "train.lr=3e-3"]


def _losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if "loss" in r]


def _train_worker(rank, world, overrides, out_dir, data_dir):
    os.environ["DIST_MOE_DATA"] = data_dir
    os.environ.setdefault("LOCAL_RANK", str(rank))  # what a launcher sets; deepspeed.initialize checks it
    from dist_moe.train.config import load_config
    from dist_moe.train.trainer import train

    config = None
    if "--config" in overrides:
        i = overrides.index("--config")
        config, overrides = overrides[i + 1], overrides[:i] + overrides[i + 2:]
    summary = train(load_config(config, [*COMMON, f"output.dir={out_dir}", *overrides]), quiet=True)
    assert summary["world_size"] == world and summary["steps"] > 20
    if rank == 0:
        Path(out_dir, "summary.rank0.json").write_text(json.dumps(summary))


# Each engine's runs, one after the other on one set of 2 ranks (their start costs more than a run).
RUNS = {
    "torch": [["parallel.dedup=rank", "parallel.pipeline_chunks=3"],
              ["parallel.dedup=none", "parallel.placement=round_robin"], GAR_PIPELINED],
    # the allgather dispatcher and GAR on Megatron-hosted experts: test_engine_megatron.py, layer by layer
    # LM: lm_branch.yaml's parallel.dedup node takes both engines through dist-moe's dispatcher (auto)
    "megatron": [["parallel.dispatcher=alltoall"], LM, MEGATRON_DIST_MOE],
    "deepspeed": [GAR, LM, DEEPSPEED_DIST_MOE],
}


@pytest.mark.parametrize("engine", sorted(RUNS))
def test_two_rank_training_with_each_in_process_engine(tmp_path, engine):
    pytest.importorskip({"torch": "torch", "deepspeed": "deepspeed", "megatron": "megatron.core"}[engine],
                        reason=f"{engine} is not installed")
    runs = [(tmp_path / f"run{i}", extra) for i, extra in enumerate(RUNS[engine])]
    run_cases(2, [(_train_worker, [f"engine={engine}", *extra, "model.capacity_factor=null"], str(out),
                   str(tmp_path / "data")) for out, extra in runs], timeout=600)
    for out, extra in runs:
        _check_run(out, engine, extra)


def _check_run(out: Path, engine: str, extra: list[str]) -> None:
    losses = _losses(out)
    assert sum(losses[-3:]) < sum(losses[:3]), (extra, losses)  # loss falls
    summary = json.loads((out / "summary.json").read_text())
    # bytes: uniform is 0.004
    assert summary["engine"] == engine and summary["val_acc"] > (0.1 if extra is LM else 0.7), extra
    # dist-moe's dispatcher logs bytes: engine torch, and the engines' dispatcher auto / dist_moe runs
    # (LM's parallel.dedup node picks it); the engines' own log none
    if engine == "torch" or extra in (MEGATRON_DIST_MOE, DEEPSPEED_DIST_MOE, LM):
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        sent = [sum(v for k, v in r.items() if k.startswith("bytes_")) for r in lines if "loss" in r]
        assert sent and all(b > 0 for b in sent)
        # each logged step's time blocked in the dispatcher's exchanges: part of that step's time
        steps = [r for r in lines if "loss" in r]
        assert all(0 < r["exchange_wait_s"] < r["step_s"] for r in steps), [(r["exchange_wait_s"], r["step_s"])
                                                                          for r in steps]
        assert 0 < summary["exchange_wait_s"] < summary["train_seconds"]
        from placement.simulate import RoutingRecord

        record = RoutingRecord.load(out)
        assert record.world_size == 2 and set(record.src_rank.tolist()) == {0, 1}
    if extra in (GAR, GAR_PIPELINED):
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert all(r["gar_loss"] < 0 for r in lines if "gar_loss" in r) and any("gar_loss" in r for r in lines)


@pytest.mark.parametrize("engine", ["deepspeed", "megatron"])
def test_one_process_runs_each_engine(tmp_path, engine):
    pytest.importorskip({"deepspeed": "deepspeed", "megatron": "megatron.core"}[engine])
    env = {**os.environ, "DIST_MOE_DATA": str(tmp_path / "data"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [str(Path(sys.executable).parent / "dist-moe"), "train", "--quiet", "--json", f"engine={engine}",
           f"output.dir={tmp_path / 'run'}", "model.capacity_factor=null", "train.max_steps=12", *COMMON[:1]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["engine"] == engine and summary["world_size"] == 1 and summary["steps"] == 12


def test_engine_errors_name_the_value(tmp_path, capsys):
    from dist_moe.cli import main

    assert main(["train", "--quiet", f"output.dir={tmp_path}", "engine=jax"]) == 2
    assert "'engine'" in capsys.readouterr().err
    pytest.importorskip("megatron.core")
    env = {**os.environ, "DIST_MOE_DATA": str(tmp_path / "data")}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([str(Path(sys.executable).parent / "dist-moe"), "train", "--quiet", "engine=megatron",
                           f"output.dir={tmp_path / 'run'}", *COMMON[:1]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2 and "model.capacity_factor: null" in proc.stderr
