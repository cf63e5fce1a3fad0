"""The run directory: run files are never written through a planted symlink, names and paths stay where
they belong, a rerun neither destroys nor mixes a finished run, and a run refused before its first step
leaves nothing it created behind."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from dist_moe.cli import main
from dist_moe.train.checkpoint import store as checkpoint
from dist_moe.train.config import load_config
from dist_moe.train.trainer import train
from tests.faults.launch import ROOT
from tests.support.dist_utils import run_workers

TINY = ["data.max_rows=300", "router.num_experts=8", "router.top_k=2", "train.max_steps=2"]


def _train(out, *overrides) -> dict:
    return train(load_config(None, [*TINY, f"output.dir={out}", *overrides]), quiet=True)


def _snapshot(folder) -> dict:
    """Every path under ``folder`` -> its bytes (files), its target (links) or None (folders)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        out[rel] = os.readlink(path) if path.is_symlink() else None if path.is_dir() else path.read_bytes()
    return out


@pytest.mark.parametrize("name", ["summary.json", "metrics.jsonl", "config.yaml", ".dist-moe.lock", "routing.npz",
                                  "checkpoints", ".next-run"])
def test_a_run_file_planted_as_a_symlink_is_refused_and_its_target_untouched(tmp_path, name):
    victim, folder = tmp_path / "victim", name in ("checkpoints", ".next-run")
    if folder:
        victim.mkdir()
        (victim / "keep").write_text("precious\n")
    else:
        victim.write_text("precious\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(victim)
    with pytest.raises(ValueError, match=rf"output.dir '{out}': {name} is a symbolic link"):
        _train(out, "train.checkpoint_every=1", *(["output.overwrite=true"] if name == ".next-run" else []))
    assert (victim / "keep" if folder else victim).read_text() == "precious\n"
    assert not folder or sorted(p.name for p in victim.iterdir()) == ["keep"]
    assert sorted(p.name for p in out.iterdir()) == [name]  # and nothing was created beside it


def test_a_symlinked_checkpoints_folder_is_not_removed_through_by_overwrite(tmp_path):
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    _train(out)
    elsewhere.mkdir()
    (elsewhere / "step-9").mkdir()
    (out / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="checkpoints is a symbolic link"):
        _train(out, "output.overwrite=true")
    assert (elsewhere / "step-9").is_dir() and (out / "metrics.jsonl").is_file()


def test_writes_replace_planted_links_at_temporary_names_and_report_files(tmp_path):
    """The old fixed temporary names (routing.npz.tmp.npz, metrics.jsonl.tmp) and every file `dist-moe
    report` writes, planted as links: each write lands in the directory, no target changes."""
    out = tmp_path / "run"
    _train(out, "train.max_steps=4", "train.checkpoint_every=2")
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "checkpoints" / checkpoint.LATEST).write_text("step-2\n")  # as if killed after step 2
    (out / "metrics.jsonl").write_text("".join(r + "\n" for r in rows) + json.dumps({"step": 3, "loss": 1.0}) + "\n")
    victims = {}

    def plant(*names):
        for name in names:
            victims[name] = tmp_path / f"victim-{name}"
            victims[name].write_text("precious\n")
            (out / name).symlink_to(victims[name])

    plant("routing.npz.tmp.npz", "metrics.jsonl.tmp")
    _train(out, "train.max_steps=4", "train.checkpoint_every=2", "train.resume=true")
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()][-1] == 4
    reports = ["report.json", "report.md", "traffic_heatmap.png", "bytes_by_level.png", "expert_load.png",
               "tree_distance.png"]
    plant(*reports)
    assert main(["report", str(out)]) == 0
    assert all(v.read_text() == "precious\n" for v in victims.values())
    for name in reports:
        assert (out / name).is_file() and not (out / name).is_symlink(), name
    assert json.loads((out / "report.json").read_text())["num_experts"] == 8


def test_a_name_with_a_path_in_it_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("../../../x", "a/b", "..", "a\\..\\b"):
        with pytest.raises(ValueError, match=r"config key 'name' must be a non-empty name without '/'"):
            load_config(None, [*TINY, f"name={name}"])
    assert load_config(None, ["data.name=../x"]).name == "demo+data.name=__x"  # a tag stays one component
    assert list(tmp_path.iterdir()) == []


def test_a_home_relative_output_dir_expands(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    summary = _train("~/runs/x")
    assert summary["output_dir"] == str(home / "runs" / "x") and (home / "runs/x/summary.json").is_file()
    assert not any(p.name.startswith("~") for p in cwd.iterdir())  # no literal ./~
    with pytest.raises(ValueError, match=r"output.dir '~no-such-user-x/r': '~no-such-user-x' is no known user"):
        load_config(None, ["output.dir=~no-such-user-x/r"])


def test_a_rerun_into_a_finished_run_is_refused_and_keeps_it_whole(tmp_path):
    """Through the CLI, as a user meets it: exit 2, one line naming both ways on, and the old run intact."""
    out = tmp_path / "run"
    _train(out, "train.max_steps=4", "train.checkpoint_every=2")
    before = _snapshot(out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "dist_moe.cli", "train", "--quiet", *TINY, f"output.dir={out}"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dist-moe: error: output.dir '{out}' already holds a run"), r.stderr
    assert "train.resume=true" in lines[0] and "output.overwrite=true" in lines[0]
    assert _snapshot(out) == before


@pytest.mark.parametrize("kept", ["no checkpoints", "none yet"])
def test_resuming_a_run_with_nothing_to_resume_from_is_refused_and_keeps_it_whole(tmp_path, capsys, kept):
    """A run without a checkpoint (train.checkpoint_every null, or stopped before its first) cannot be
    continued: starting afresh would replace its metrics and summary, so it is refused in one line."""
    out = tmp_path / "run"
    every = ["train.checkpoint_every=100"] if kept == "none yet" else []
    _train(out, "train.max_steps=4", *every)
    if kept == "none yet":  # as if killed before its first save (the last step always saves)
        shutil.rmtree(out / "checkpoints")
    before = _snapshot(out)
    assert main(["train", "--quiet", *TINY, f"output.dir={out}", *every, "train.resume=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dist-moe: error: train.resume=true: output.dir '{out}' holds a run (metrics.jsonl, "
                          "summary.json) but no checkpoint to continue from") and len(err.splitlines()) == 1, err
    assert ("none are kept" if kept == "no checkpoints" else "before its first") in err
    assert _snapshot(out) == before
    assert _train(tmp_path / "new", "train.resume=true")["steps"] == 2  # a new directory: nothing to continue, trains


def test_overwrite_removes_the_old_run_and_nothing_else(tmp_path):
    out = tmp_path / "run"
    _train(out, "train.max_steps=4", "train.checkpoint_every=2", "output.tensorboard=false")
    assert main(["report", str(out)]) == 0
    (out / "routing.layer1.npz").write_bytes(b"a stale layer")  # from a run with more layers
    (out / "notes.txt").write_text("mine\n")
    (out / "placement.yaml").write_text("mine too\n")
    _train(out, "output.overwrite=true", "train.checkpoint_every=1", "train.max_steps=1")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-1"]  # no step-4 beside it
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1, 1]
    assert (out / "notes.txt").read_text() == "mine\n" and (out / "placement.yaml").read_text() == "mine too\n"
    assert not (out / "report.md").exists() and not (out / "routing.layer1.npz").exists()
    with pytest.raises(ValueError, match="set one of them"):
        load_config(None, ["output.overwrite=true", "train.resume=true"])


def test_an_overwrite_stopped_midway_leaves_the_previous_run_whole_and_a_finished_one_replaces_it(
        tmp_path, monkeypatch, capsys):
    """output.overwrite trains beside the run it replaces: Ctrl-C at its third step (two trained, a checkpoint
    saved) leaves that run byte for byte as it was, report included, and says where the new run's files are
    (not that train.resume continues them: it would continue the old run); a finished one then replaces it,
    and a resume continues the run now in place."""
    from dist_moe.train import trainer

    out = tmp_path / "run"
    _train(out, "train.checkpoint_every=2")
    (out / "report.md").write_text("the old run's report\n")  # as dist-moe report leaves it (plots: seconds)
    before = _snapshot(out)
    step = trainer._TrainingRun.train_step
    seen = []

    def ctrl_c_at_step_3(self):
        seen.append(_snapshot(out))  # the directory as a user sees it while the new run trains
        if self.step == 2:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(trainer._TrainingRun, "train_step", ctrl_c_at_step_3)
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt) as stopped:
        _train(out, "output.overwrite=true", "train.max_steps=4", "train.checkpoint_every=1", "seed=1")
    assert "train.resume" not in str(stopped.value)
    staged = out / ".next-run"
    assert f"the run in {out} is untouched; this run's files, which were to replace it, are in {staged}" in \
        capsys.readouterr().err
    assert len(seen) == 3 and all(_old_run(s) == _old_run(before) for s in [*seen, _snapshot(out)])
    assert checkpoint.latest(staged / "checkpoints").name == "step-2"  # the new run's, apart from the old
    monkeypatch.setattr(trainer._TrainingRun, "train_step", step)
    summary = _train(out, "output.overwrite=true", "train.max_steps=3", "train.checkpoint_every=3", "seed=2")
    assert summary["output_dir"] == str(out)
    names = sorted(p.name for p in out.iterdir())
    assert ".next-run" not in names and ".previous-run" not in names and "report.md" not in names
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-3"]
    assert _train(out, "train.max_steps=4", "train.resume=true", "seed=2")["steps"] == 4


def _old_run(snapshot: dict) -> dict:
    """A run directory's snapshot without the new run's staging folder and the lock (it holds the last pid)."""
    return {k: v for k, v in snapshot.items() if k.split("/")[0] not in (".next-run", ".dist-moe.lock")}


@pytest.mark.parametrize("bad", ["router.num_experts=0", "router.num_experts=1099511627776", "first_step"])
def test_a_run_stopped_before_its_first_step_leaves_nothing_behind(tmp_path, monkeypatch, bad):
    if bad == "first_step":
        from dist_moe.train import trainer

        def fail(self):
            raise RuntimeError("planted failure in the first step")

        monkeypatch.setattr(trainer._TrainingRun, "train_step", fail)
    fresh = tmp_path / "new" / "deeper" / "run"
    with pytest.raises((ValueError, RuntimeError)):
        _train(fresh, bad if bad != "first_step" else "seed=0")
    assert list(tmp_path.iterdir()) == []  # the directories it made are gone, parents included
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine\n")
    with pytest.raises((ValueError, RuntimeError)):
        _train(existing, bad if bad != "first_step" else "seed=0")
    assert _snapshot(existing) == {"notes.txt": b"mine\n"}  # no lock file, no config.yaml, no metrics


def _two_ranks(rank, world, out):
    from pathlib import Path

    import pytest as pt

    before = _snapshot(Path(out))
    with pt.raises(ValueError, match="already holds a run") as refused:
        _train(out)
    assert ("rank 0: " in str(refused.value)) == (rank == 1)  # rank 1 reports rank 0's verdict
    with pt.raises(ValueError, match="num_experts"):
        _train(f"{out}-fresh", "router.num_experts=0")
    if rank == 0:  # rank 1 waits for it in the next run's start-up checks
        assert _snapshot(Path(out)) == before
    # both ranks write their shards beside the old run; rank 0 swaps the new run in once both are done
    _train(out, "output.overwrite=true", "train.checkpoint_every=2")


def test_two_ranks_refuse_together_leave_nothing_and_replace_a_run_together(tmp_path):
    out = tmp_path / "run"
    _train(out)
    run_workers(_two_ranks, 2, args=(str(out),), timeout=180)
    assert not (tmp_path / "run-fresh").exists()
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    assert not (out / ".next-run").exists() and not (out / ".previous-run").exists()
    assert checkpoint.verify(checkpoint.latest(out / "checkpoints"))  # whole: both ranks' shards moved with it
