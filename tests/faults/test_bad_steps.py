"""NaN / Inf in inputs or gradients: the step is skipped on every rank and counted; router state
(BRANCH anchors and EMA step, DeepSeek-V3 biases), parameters and optimizer state are untouched;
more than train.max_skipped_steps stops the run with a clear error on every rank."""
import functools
import json
import math
import os
import pathlib

import pytest
import torch

from dist_moe.train import trainer
from dist_moe.train.config import load_config
from dist_moe.train.step import training_step
from tests.support.dist_utils import run_workers


def _state(model, opt) -> dict:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"o{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    return out


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _inject(monkeypatch, bad_calls: dict, checks: list):
    """Poison step n of ``bad_calls``: NaN / Inf inputs (screened by the trainer before any forward)
    or a NaN expert gradient (found by the step function); record whether the step was skipped and
    whether model and optimizer state came out of it unchanged."""
    real_screen, real_call = trainer.screened, training_step.PlainStep.__call__
    seen = {"calls": 0, "pending": None}

    def settle(model_opt):
        if seen["pending"] is not None:
            before, skipped = seen["pending"]
            checks.append((skipped, _same(before, _state(*model_opt))))
            seen["pending"] = None

    def screen(xb):
        seen["calls"] += 1
        settle(seen.get("refs"))
        poison = bad_calls.get(seen["calls"], "")
        if poison.startswith("input"):
            xb[0, 0] = float("nan") if poison == "input_nan" else float("inf")
            seen["pending"] = (_state(*seen["refs"]), 1.0)
        xb, bad = real_screen(xb)
        assert bool(bad) == poison.startswith("input")  # a poisoned batch is always caught, on this rank
        assert torch.isfinite(xb).all()  # and runs zeroed
        return xb, bad

    def step(self, model, step_fn, xb, yb, cb, **kw):
        real_step = functools.partial(real_call, self)
        seen["refs"] = (model, step_fn.opt)
        if bad_calls.get(seen["calls"]) != "grad_nan":
            return real_step(model, step_fn, xb, yb, cb, **kw)
        before = _state(model, step_fn.opt)
        expert_weight = next(p for n, p in model.moe.named_parameters() if "expert" in n and p.requires_grad)
        handle = expert_weight.register_hook(lambda g: torch.full_like(g, float("nan")))
        record = real_step(model, step_fn, xb, yb, cb, **kw)  # a finite loss, a NaN gradient on this rank
        handle.remove()
        checks.append((float(record["skipped"]), _same(before, _state(model, step_fn.opt))))
        return record

    monkeypatch.setattr(trainer, "screened", screen)
    monkeypatch.setattr(training_step.PlainStep, "__call__", step)


@pytest.mark.parametrize("router, engine", [("branch", "torch"), ("deepseek_v3", "torch"), ("branch", "deepspeed")])
def test_bad_inputs_are_skipped_and_leave_no_trace(tmp_path, monkeypatch, router, engine):
    # engine deepspeed sets RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_PORT for its one-rank group in
    # this process's environment, and removes them when the run ends: later runs and launched ranks
    # would inherit a port that is still held
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    before = {k: os.environ.get(k) for k in keys}
    _run_bad_inputs(tmp_path, monkeypatch, router, engine)
    assert {k: os.environ.get(k) for k in keys} == before

def _run_bad_inputs(tmp_path, monkeypatch, router, engine):
    checks = []
    _inject(monkeypatch, {3: "input_nan", 4: "input_inf", 7: "grad_nan"}, checks)
    cfg = load_config(None, [f"router.type={router}", f"engine={engine}", "data.max_rows=2000", "train.max_steps=12",
                             "train.batch_size=64", f"output.dir={tmp_path}", "train.log_every=1"])
    summary = trainer.train(cfg, quiet=True)
    assert checks == [(1.0, True)] * 3  # skipped, and every tensor of model and optimizer unchanged
    assert summary["skipped_steps"] == 3 and summary["steps"] == 12
    assert summary["val_loss"] is not None and summary["val_loss"] < 1.0


def test_too_many_bad_steps_stop_the_run(tmp_path, monkeypatch):
    _inject(monkeypatch, {3: "input_nan", 4: "input_nan"}, [])
    cfg = load_config(None, ["data.max_rows=2000", "train.max_steps=6", f"output.dir={tmp_path}",
                             "train.max_skipped_steps=1"])
    with pytest.raises(ValueError, match="2 steps had a non-finite loss or gradients"):
        trainer.train(cfg, quiet=True)


def _two_rank_worker(rank, world, out):
    import pytest as pt

    monkey = pt.MonkeyPatch()
    checks = []
    # rank 1 alone sees a NaN expert gradient at its 4th step, then NaN inputs at its 6th and 7th
    _inject(monkey, {4: "grad_nan"} if rank == 0 else {4: "grad_nan", 6: "input_nan", 7: "input_inf"}, checks)
    cfg = load_config(None, ["router.type=branch", "data.max_rows=2000", "train.max_steps=10",
                             "train.batch_size=32", f"output.dir={out}", "train.max_skipped_steps=3"])
    summary = trainer.train(cfg, quiet=True)
    assert summary["skipped_steps"] == 3 and summary["steps"] == 10
    assert checks and all(same for _, same in checks)
    monkey.undo()
    _inject(monkey, {4: "grad_nan"} if rank == 0 else {4: "grad_nan", 6: "input_nan", 7: "input_inf"}, [])
    cfg.train.max_skipped_steps = 2  # the same run again must stop on both ranks together
    cfg.output.overwrite = True
    with pt.raises(ValueError, match="3 steps had a non-finite"):
        trainer.train(cfg, quiet=True)
    monkey.undo()


def test_a_bad_step_on_one_rank_is_skipped_by_all(tmp_path):
    run_workers(_two_rank_worker, 2, args=(str(tmp_path),), timeout=180)


def _checkpoint_tensors(step_dir, out_file) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(out_file))  # our own files: loaded as plain tensors
    return torch.load(out_file, weights_only=True)


def _assert_all_skipped_and_checkpoints_finite(out, steps: int, where: str) -> None:
    """Every step skipped: each checkpoint finite and equal to the first (no update reached the model)."""
    ckpts = [out / "checkpoints" / f"step-{s}" for s in range(1, steps + 1)]
    first = _checkpoint_tensors(ckpts[0], out / f"first.{where}.pt")
    for c in ckpts[1:]:
        later = _checkpoint_tensors(c, out / f"later.{where}.pt")
        for k, t in first.items():
            if torch.is_tensor(t) and t.is_floating_point():
                assert bool(torch.isfinite(later[k]).all()), (where, c.name, k)
                if k.startswith(("model.", "optim.")):
                    assert torch.equal(t, later[k]), (where, c.name, k)


GAR_1E300 = ["--config", "configs/tabular_switch_gar.yaml", "data.max_rows=2000", "train.batch_size=64",
             "train.epochs=1", "train.checkpoint_every=1", "train.log_every=1"]


@pytest.mark.parametrize("coefficient", ["train.gar.lambda=1e300", "train.gar.lambda=null train.gar.share=1e300"])
def test_a_gar_step_with_non_finite_gradients_is_skipped_and_never_checkpointed(tmp_path, capsys, coefficient):
    from dist_moe.cli import main

    code = main(["train", "--quiet", *GAR_1E300, *coefficient.split(), "train.max_skipped_steps=3",
                 f"output.dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "training diverged: 4 steps had a non-finite loss or gradients" in err[-1], err
    assert coefficient.split()[-1].split("=")[0] in err[-1]  # the coefficient to lower
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # the 4th skipped step stops the run before it is logged or saved
    assert [r["skipped"] for r in rows] == [1.0] * 3 and all(math.isfinite(r["loss"]) for r in rows)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-3"
    _assert_all_skipped_and_checkpoints_finite(tmp_path, 3, "one process")
    # the run's state is not lost: it resumes from its newest checkpoint with a sane coefficient
    code = main(["train", "--quiet", *GAR_1E300, "train.gar.lambda=0.001", "train.gar.share=null", "train.resume=true",
                 f"output.dir={tmp_path}"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["skipped_steps"] == 0 and summary["samples"] == 1600 and summary["samples_this_run"] == 1600 - 3 * 64


def _gar_engine_worker(rank, world, engine, coefficient, out, data_dir):
    os.environ["DIST_MOE_DATA"] = data_dir
    os.environ.setdefault("LOCAL_RANK", str(rank))  # what a launcher sets; deepspeed.initialize checks it
    cfg = load_config("configs/tabular_switch_gar.yaml", [
        f"engine={engine}", "model.capacity_factor=null", *coefficient.split(), "data.max_rows=1000",
        "train.batch_size=32", "train.gar_group_size=16", "train.max_steps=3", "train.max_skipped_steps=5",
        "train.checkpoint_every=1", f"output.dir={out}"])
    with pytest.raises(ValueError, match="training took no step: all 3 steps of this run had a non-finite loss"):
        trainer.train(cfg, quiet=True)  # every step skipped, on every rank: no trained model to report
    if rank == 1:  # rank 0 wrote the files; the other rank checks them
        _assert_all_skipped_and_checkpoints_finite(pathlib.Path(out), 3, f"{engine} rank {rank}")


def test_a_non_finite_gar_step_is_skipped_on_every_rank_of_each_engine(tmp_path):
    from tests.support.dist_utils import run_cases

    coefficients = {"torch": "train.gar.lambda=1e300", "deepspeed": "train.gar.lambda=null train.gar.share=1e300",
                    "megatron": "train.gar.lambda=1e300"}
    cases = [(_gar_engine_worker, engine, coefficient, str(tmp_path / engine), str(tmp_path / "data"))
             for engine, coefficient in coefficients.items()]
    run_cases(2, cases, timeout=400)


def test_a_run_whose_every_step_was_skipped_is_refused(tmp_path, monkeypatch, capsys):
    """Within train.max_skipped_steps, but not one step taken: the run ends in one line, not with exit 0
    and a summary of the untrained model."""
    from dist_moe.cli import main

    _inject(monkeypatch, {n: "grad_nan" for n in range(1, 5)}, [])
    assert main(["train", "--quiet", "data.max_rows=2000", "train.max_steps=4", f"output.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dist-moe: error: training took no step: all 4 steps of this run had a non-finite loss") \
        and len(err.splitlines()) == 1, err
    assert not (tmp_path / "summary.json").exists() and (tmp_path / "metrics.jsonl").is_file()
    _inject(monkeypatch, {n: "grad_nan" for n in range(1, 4)}, [])  # one step of four taken: a run
    assert main(["train", "--quiet", "data.max_rows=2000", "train.max_steps=4", f"output.dir={tmp_path}/b"]) == 0
