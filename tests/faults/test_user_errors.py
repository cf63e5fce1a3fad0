"""Every user-facing failure of `dist-moe` ends in one clear line and exit code 2 (the user's input)
or 1 (the run failed), never a Python traceback (unless --debug)."""
import errno
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from dist_moe.cli import main
from dist_moe.train.checkpoint import store as checkpoint
from tests.faults.launch import ROOT

TINY = ["--quiet", "data.max_rows=300", "router.num_experts=8", "router.top_k=2", "train.epochs=1"]


def _cli(capsys, *args) -> tuple[int, str]:
    code = main(list(args))
    err = capsys.readouterr().err.strip()
    return code, err


def _one_line(err: str, *fragments: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dist-moe: error: "), err
    for f in fragments:
        assert f in lines[0], (f, err)


@pytest.mark.parametrize("args,fragments", [
    (["train", "router.num_experts=1099511627776"], ["num_experts must be at most 65536"]),
    (["train", "seed=18446744073709551616"], ["'seed'", "2**63 - 1"]),
    (["train", "model.ffn_hidden_size=100000000"], ["GiB", "more than"]),
    (["train", "output.dir=/proc/dist-moe-run"], ["output.dir '/proc/dist-moe-run' is not writable"]),
    (["train", "output.dir=/etc/hostname/run"], ["is not writable"]),
    (["simulate", "--nodes", "2", "--gpus-per-node", "2", "--stats", "x", "--tokens-per-rank", "0"],
     ["--tokens-per-rank must be >= 1, got 0"]),
    (["place", "--topology", "node=2,gpu=4", "--stats", "x", "--out", "/no/such/folder/p.yaml"],
     ["'/no/such/folder' does not exist"]),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, args, fragments):
    if args[0] == "train" and not any(a.startswith("output.dir=") for a in args):
        args = [*args, f"output.dir={tmp_path / 'run'}"]  # never ./runs; and a refused run leaves no directory
    code, err = _cli(capsys, *args)
    assert code == 2
    _one_line(err, *fragments)
    assert not (tmp_path / "run").exists()


def test_a_huge_simulated_cluster_is_refused_before_allocating(capsys, tmp_path):
    assert main(["train", *TINY, f"output.dir={tmp_path}"]) == 0
    capsys.readouterr()
    code, err = _cli(capsys, "simulate", "--nodes", "100000", "--gpus-per-node", "8", "--stats", str(tmp_path))
    assert code == 2
    _one_line(err, "800000 ranks", "GiB", "available")


def test_non_utf8_yaml_names_the_file(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"name: \xff\xfe\n")
    code, err = _cli(capsys, "train", "--config", str(bad))
    assert code == 2
    _one_line(err, str(bad), "not UTF-8")


def test_debug_shows_the_traceback(capsys, tmp_path):
    with pytest.raises(ValueError, match="num_experts"):
        main(["train", "--debug", "router.num_experts=0", f"output.dir={tmp_path / 'run'}"])


def test_a_full_disk_is_one_line_and_exit_1(capsys, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "checkpoints"))

    monkeypatch.setattr(checkpoint, "save", full)
    code, err = _cli(capsys, "train", *TINY, "train.checkpoint_every=1", f"output.dir={tmp_path}")
    assert code == 1
    _one_line(err, "no space left on the device", "train.resume=true")


def _tamper_cache(data_dir, column: int | None = None, label: int | None = None):
    path = data_dir / "keel_magic.npz"
    z = dict(np.load(path, allow_pickle=False))
    if column is not None:
        z["x"][[3, 9], column] = np.nan
    if label is not None:
        z["y"][5] = label
    np.savez(path, **z)
    return path


@pytest.mark.parametrize("column,label,fragments", [
    (4, None, ["2 non-finite cells", "column 4: 2"]),
    (None, 7, ["1 labels outside [0, 2)", "e.g. 7 in row 5"]),
])
def test_bad_cells_in_a_cached_table_name_file_column_and_count(capsys, tmp_path, monkeypatch, column, label,
                                                                fragments):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path / "data"))
    assert main(["train", *TINY, f"output.dir={tmp_path / 'ok'}"]) == 0
    capsys.readouterr()
    path = _tamper_cache(tmp_path / "data", column, label)
    code, err = _cli(capsys, "train", *TINY, f"output.dir={tmp_path / 'bad'}")
    assert code == 2
    _one_line(err, str(path), *fragments)


def test_resuming_with_another_model_names_the_key(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["train", *TINY, "train.checkpoint_every=2", f"output.dir={out}"]) == 0
    capsys.readouterr()
    for key, value in (("router.num_experts", 16), ("router.top_k", 3), ("model.ffn_hidden_size", 64)):
        code, err = _cli(capsys, "train", *TINY, f"{key}={value}", "train.resume=true", f"output.dir={out}")
        assert code == 2
        _one_line(err, f"config key {key!r}", "checkpoint", "new output.dir")
    # a checkpoint from before configs were kept: the load itself says it does not fit, in one line
    latest = checkpoint.latest(out / "checkpoints")
    (latest / checkpoint.CONFIG).unlink()
    manifest = json.loads((latest / checkpoint.MANIFEST).read_text())
    del manifest["files"][checkpoint.CONFIG]
    (latest / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    for key, value, says in (("router.num_experts", 16, "lacks"), ("model.ffn_hidden_size", 64, "does not fit")):
        code, err = _cli(capsys, "train", *TINY, f"{key}={value}", "train.resume=true", f"output.dir={out}")
        assert code == 2
        _one_line(err, says)


@pytest.mark.parametrize("pointer", ["../../../etc", "step-2/../../..", "/tmp", "step-2 x"])
def test_latest_must_name_a_step_of_this_run(tmp_path, pointer):
    out = tmp_path / "run"
    assert main(["train", *TINY, "train.checkpoint_every=2", f"output.dir={out}"]) == 0
    (out / "checkpoints" / "latest").write_text(pointer + "\n")
    with pytest.raises(checkpoint.CheckpointError, match="not a step-<N> checkpoint"):
        checkpoint.latest(out / "checkpoints")


def test_manifest_entries_stay_inside_the_step(tmp_path):
    out = tmp_path / "run"
    assert main(["train", *TINY, "train.checkpoint_every=2", f"output.dir={out}"]) == 0
    latest = checkpoint.latest(out / "checkpoints")
    manifest = json.loads((latest / checkpoint.MANIFEST).read_text())
    manifest["files"]["../../config.yaml"] = {"bytes": 1, "sha256": "0" * 64}
    (latest / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match="not a file of the checkpoint .a path outside it"):
        checkpoint.verify(latest)


def test_resuming_a_finished_run_says_so(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["train", *TINY, "train.checkpoint_every=2", f"output.dir={out}"]) == 0
    capsys.readouterr()
    assert main(["train", *TINY, "train.resume=true", f"output.dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert "had already finished" in printed and "validation loss n/a" not in printed


def test_a_second_run_on_the_same_output_dir_is_refused(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-m", "dist_moe.cli", "train", *TINY, "train.max_steps=100000",
                              f"output.dir={out}"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (out / "metrics.jsonl").exists():  # the first run holds the lock and trains
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        second = subprocess.run([sys.executable, "-m", "dist_moe.cli", "train", *TINY, f"output.dir={out}"],
                                env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        _one_line(second.stderr.strip(), f"output.dir {str(out)!r} is in use", f"(pid {first.pid})")
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()
        first.wait()


def test_ctrl_c_names_how_to_resume_when_the_run_has_a_checkpoint(tmp_path, capsys, monkeypatch):
    """Ctrl-C mid-run: one line and exit 130; with a checkpoint saved, the line says train.resume=true
    continues from it (before: 'interrupted' alone)."""
    from dist_moe.train import trainer

    saved = trainer._TrainingRun.maybe_checkpoint

    def ctrl_c_at_step_4(self, last):
        saved(self, last)
        if self.step == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(trainer._TrainingRun, "maybe_checkpoint", ctrl_c_at_step_4)
    out = tmp_path / "run"
    code, err = _cli(capsys, "train", *TINY, "train.batch_size=16", "train.checkpoint_every=2", f"output.dir={out}")
    assert code == 130
    assert err == f"dist-moe: error: interrupted; train.resume=true continues from {out / 'checkpoints' / 'step-4'}"
    code, err = _cli(capsys, "train", *TINY, "train.batch_size=16", f"output.dir={tmp_path / 'plain'}")  # none saved
    assert (code, err) == (130, "dist-moe: error: interrupted")


def test_an_output_dir_under_a_file_and_a_missing_run_directory_are_named(tmp_path, capsys):
    (tmp_path / "notes.md").write_text("a file\n")
    code, err = _cli(capsys, "train", *TINY, f"output.dir={tmp_path / 'notes.md' / 'run'}")
    assert code == 2
    _one_line(err, f"output.dir '{tmp_path / 'notes.md' / 'run'}' is not writable: '{tmp_path / 'notes.md'}' is a "
                   "file, not a folder")
    code, err = _cli(capsys, "report", str(tmp_path / "no-such-run"))
    assert code == 2
    _one_line(err, f"run directory '{tmp_path / 'no-such-run'}' does not exist")


def test_the_progress_bar_names_the_run_not_its_config(tmp_path, capsys):
    out = tmp_path / "demo_4ranks"  # the embedded config is named demo
    code = main(["train", *TINY[1:], f"output.dir={out}"])
    err = capsys.readouterr().err
    assert code == 0 and "demo_4ranks: 100%" in err and "demo: " not in err, err[-2000:]
