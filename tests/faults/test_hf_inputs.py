"""``model.kind: hf`` on a user's model folder that cannot work, and the trained model's export when it
cannot be written as it was. A refusal is one line and exit 2, before anything large is built, with no
transformers report or notice and no Rust panic before it (stderr is read at the file descriptor, where
those are written); an export never holds NaN or Inf, never leaves the run without ``hf_model/`` once it
had one, never leaves its hidden folders behind, and keeps the tokenizer it started with."""
from __future__ import annotations

import json
import pathlib
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from dist_moe.cli import main
from dist_moe.dispatch.exchange import ExchangeConfig
from dist_moe.integrations.transformers.hosted import host_experts
from dist_moe.models import hf_export, hf_model
from dist_moe.models.hf_model import HFCausalLM, load_model, load_tokenizer
from placement import Placement, Topology
from tests.support.hf_models import model_folder, text

pytest.importorskip("transformers", reason="transformers is not installed")


@pytest.fixture(autouse=True)
def _data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path / "data"))
    (tmp_path / "t.txt").write_text(text(40))


@pytest.fixture
def stderr(capfd, monkeypatch):
    """What reaches file descriptor 2 during the test, where a user's terminal shows it all: Rust's panic
    hook writes there, and transformers' log handler, which keeps the sys.stderr of the moment it was made
    (pytest's, for an earlier test), is pointed at this test's."""
    from transformers.utils import logging

    logging.get_logger("transformers")  # makes the handler, if no import has yet
    monkeypatch.setattr(logging._default_handler, "stream", sys.stderr)
    monkeypatch.setattr(logging._default_handler, "flush", sys.stderr.flush)
    return capfd


def _train(tmp_path, folder: Path, *args) -> int:
    return main(["train", "--quiet", f"output.dir={tmp_path / 'run'}", "train.max_steps=2", "data.seq_len=16",
                 "train.batch_size=4", "model.kind=hf", f"model.path={folder}", f"data.name={tmp_path / 't.txt'}",
                 *args])


def _seen(stderr) -> list[str]:
    """The lines a user saw on stderr, less transformers' progress bar while it reads weights."""
    return [line for line in stderr.readouterr().err.splitlines() if line.strip() and "it/s]" not in line]


def _refused(stderr, tmp_path, folder: Path, message: str) -> None:
    stderr.readouterr()  # what making the folder printed
    rc = _train(tmp_path, folder)
    lines = _seen(stderr)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"dist-moe: error: model.path='{folder}': ") and message in lines[0], lines
    assert not (tmp_path / "run").exists()


def _edited(folder: Path, **values) -> Path:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **values}))  # NaN and inf as Python's json writes them
    return folder


@pytest.fixture
def nothing_built(monkeypatch):
    """A model built (even on the meta device, to count its parameters) before the refusal fails the test."""
    def built(*args, **kwargs):
        raise AssertionError("a model was built before its config.json was refused")

    monkeypatch.setattr("dist_moe.train.build_hf.parameter_count", built)
    monkeypatch.setattr("dist_moe.train.build_hf.load_model", built)


@pytest.mark.parametrize("kind,values,message", [
    ("mixtral", {"num_hidden_layers": 200000}, "num_hidden_layers=200000: dist-moe builds at most 1024"),
    ("mixtral", {"num_attention_heads": 2 ** 20}, "num_attention_heads=1048576, more heads than hidden_size=32"),
    ("mixtral", {"num_attention_heads": 3}, "num_attention_heads=3, which does not divide hidden_size=32"),
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok=9, more than its 8 experts (num_local_experts)"),
    ("mixtral", {"hidden_size": 64.5}, "Field 'hidden_size' expected int, got float (value: 64.5)"),
    ("mixtral", {"num_hidden_layers": 0}, "num_hidden_layers=0: it must be a positive integer"),
    ("mixtral", {"hidden_size": -32}, "hidden_size=-32: it must be a positive integer"),
    ("mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok=0: it must be a positive integer"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts=0 (or num_experts): it must be a positive integer"),
    ("mixtral", {"vocab_size": 0}, "vocab_size=0: it must be a positive integer"),
    ("mixtral", {"num_key_value_heads": 3}, "num_key_value_heads=3, which does not divide num_attention_heads=2"),
    ("mixtral", {"rms_norm_eps": float("nan")}, "rms_norm_eps=nan: every number in it must be finite"),
    ("mixtral", {"rms_norm_eps": -1e-6}, "rms_norm_eps=-1e-06: it must be a positive number"),
    ("mixtral", {"router_aux_loss_coef": float("inf")}, "router_aux_loss_coef=inf: every number in it must be finite"),
    ("qwen3_moe", {"num_local_experts": 1 << 17},
     "num_local_experts=131072 (or num_experts): dist-moe hosts at most 65536 experts"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9, more than its 8 experts (num_local_experts)"),
    ("deepseek_v3", {"n_group": 3}, "n_group=3, which does not cut its 8 experts (n_routed_experts) into equal"),
    ("deepseek_v3", {"topk_group": 3}, "topk_group=3, more than n_group=2"),
    ("deepseek_v3", {"num_experts_per_tok": 5}, "num_experts_per_tok=5, more than the 4 experts of its topk_group=1"),
])
def test_a_config_json_out_of_range_is_refused_naming_key_and_value(tmp_path, stderr, nothing_built, kind, values,
                                                                   message):
    _refused(stderr, tmp_path, _edited(model_folder(tmp_path / "m", kind), **values), message)


def _weights(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("change,message", [
    (lambda w: w.pop("lm_head.weight"), "(1 missing keys, e.g. lm_head.weight)"),
    (lambda w: w.update({"lm_head.weight": torch.zeros(3, 3)}),
     "(1 mismatched keys, e.g. lm_head.weight of shape [3, 3] where the config gives [300, 32])"),
    (lambda w: w.update({"model.extra.weight": torch.zeros(3)}), "(1 unexpected keys, e.g. model.extra.weight)"),
])
def test_weights_that_do_not_fit_are_one_line_without_transformers_load_report(tmp_path, stderr, change, message):
    folder = model_folder(tmp_path / "m", "mixtral", weights=True)
    _weights(folder, change)
    _refused(stderr, tmp_path, folder, f"its weights do not fit its config.json {message}")


def test_a_pickled_tokenizer_model_is_one_line_without_a_sentencepiece_notice(tmp_path, stderr):
    folder = model_folder(tmp_path / "m", "mixtral")
    (folder / "tokenizer.model").write_bytes(pickle.dumps({"not": "a SentencePiece model"}))
    _refused(stderr, tmp_path, folder, "its tokenizer cannot be loaded")


def test_a_tokenizer_whose_regex_makes_tokenizers_panic_is_one_line(tmp_path, stderr, monkeypatch):
    """A pre-tokenizer regex that backtracks without end: the Rust regex engine gives up with a panic,
    which pyo3 raises as a BaseException after Rust's panic hook has written to stderr (a whole stack
    with RUST_BACKTRACE)."""
    monkeypatch.setenv("RUST_BACKTRACE", "1")
    folder = model_folder(tmp_path / "m", "mixtral", tokenizer_text=text(40))
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated",
                             "invert": False}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "t.txt").write_text(text(40) + "a" * 100 + "b\n")
    _refused(stderr, tmp_path, folder, f"its tokenizer broke down on '{tmp_path / 't.txt'}' (tokenizers panicked: "
                                      "Onig: Regex search error")


def test_weights_linked_from_outside_the_folder_load_as_the_hub_cache_lays_them_out(tmp_path):
    """A kept decision: the Hugging Face hub cache's snapshot folders hold links into its blobs folder, so
    a weights file may be a link out of the model folder. It is read as safetensors (tensors only), and
    every tensor must still fit the config."""
    folder = model_folder(tmp_path / "m", "mixtral", weights=True)
    (tmp_path / "blobs").mkdir()
    (folder / "model.safetensors").rename(tmp_path / "blobs" / "0a1b2c")
    (folder / "model.safetensors").symlink_to("../blobs/0a1b2c")
    want = model_folder(tmp_path / "same", "mixtral", weights=True)
    got, same = load_model(folder, 1).state_dict(), load_model(want, 1).state_dict()
    assert all(torch.equal(got[k], same[k]) for k in same)


def _hosted_model(tmp_path: Path, tokenizer: bool = False) -> HFCausalLM:
    folder = model_folder(tmp_path / "m", "mixtral", weights=True, tokenizer_text=text(20) if tokenizer else None)
    model = load_model(folder, 0)
    host_experts(model, lambda e: Placement.contiguous(e, 1), Topology.launched(1), None, ExchangeConfig())
    return HFCausalLM(model, folder, load_tokenizer(folder) if tokenizer else None)


def _saved(target: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(target / "model.safetensors")


def _hidden(run: Path) -> list[str]:
    """What exports left beside ``run/hf_model``."""
    return sorted(p.name for p in run.iterdir() if p.name.startswith(".hf_model"))


def test_an_export_holding_nan_is_refused_naming_the_tensor_and_keeps_the_previous_one(tmp_path):
    wrapped = _hosted_model(tmp_path)
    target = tmp_path / "run" / "hf_model"
    target.parent.mkdir()
    wrapped.export(target, True)
    before = _saved(target)
    experts = wrapped.hf.model.layers[1].mlp.experts
    with torch.no_grad():
        experts.down_proj[3, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^not writing the trained model to .*hf_model: "
                                         r"'model.layers.1.mlp.experts.down_proj' holds NaN or Inf \(the previous "
                                         r"one is kept\)"):
        wrapped.export(target, True)
    after = _saved(target)
    assert all(torch.equal(after[k], t) for k, t in before.items()) and _hidden(target.parent) == []


class Killed(BaseException):
    """The process is gone: this step and every later one never happen."""


def _kill_at(monkeypatch, step: int) -> None:
    """Every rename, exchange and removal of a folder is a step; from the ``step``-th on, each raises
    ``Killed`` without touching the disk (a ``finally`` that cleans up is killed too)."""
    done = [0]

    def counted(real):
        def step_of_the_swap(*args, **kwargs):
            done[0] += 1
            if done[0] > step:
                raise Killed
            return real(*args, **kwargs)
        return step_of_the_swap

    monkeypatch.setattr(pathlib.Path, "rename", counted(pathlib.Path.rename))
    monkeypatch.setattr(shutil, "rmtree", counted(shutil.rmtree))
    monkeypatch.setattr(hf_export, "_exchange", counted(hf_export._exchange))


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two renames"])
def test_a_kill_at_any_step_of_the_swap_keeps_a_whole_model_and_the_next_export_clears_what_it_left(
        tmp_path, monkeypatch, exchange):
    """With an atomic exchange ``hf_model/`` holds the previous model or the new one whenever the kill
    comes; where the file system has none (two renames), the next start puts a whole one back."""
    if not exchange:
        monkeypatch.setattr(hf_export, "_exchange", lambda a, b: False)
    wrapped = _hosted_model(tmp_path)
    target = tmp_path / "run" / "hf_model"
    target.parent.mkdir()
    wrapped.export(target, True)
    old = _saved(target)
    with torch.no_grad():
        wrapped.hf.lm_head.weight.add_(1.0)
    new_state = wrapped.export_state(True)
    for step in range(20):
        with monkeypatch.context() as m:
            _kill_at(m, step)
            try:
                wrapped.write(new_state, target)
                finished = True
            except Killed:
                finished = False
        if not exchange:
            hf_export.settle_export(target)  # what the next export or a resume does first
        saved = _saved(target)  # a whole model: the previous one or the new one
        assert torch.equal(saved["lm_head.weight"], old["lm_head.weight"]) or \
            torch.equal(saved["lm_head.weight"], new_state["lm_head.weight"]), step
        wrapped.write(new_state, target)
        assert torch.equal(_saved(target)["lm_head.weight"], new_state["lm_head.weight"])
        assert _hidden(target.parent) == [], (step, _hidden(target.parent))
        if finished:
            break
    assert finished and step >= 2


def test_an_export_clears_an_earlier_killed_exports_folders_and_keeps_the_tokenizer_it_started_with(
        tmp_path, monkeypatch):
    """Through ``dist-moe train``: the folder's tokenizer files are deleted while the run trains, and a
    killed export of an earlier run left its folders (one half-written, one holding the model before)."""
    from dist_moe.train import trainer

    folder = model_folder(tmp_path / "m", "mixtral", tokenizer_text=text(40))
    run = tmp_path / "run"
    (run / ".hf_model.k3j4h5g6").mkdir(parents=True)
    (run / ".hf_model.old.a8b7c6d5" / "hf_model").mkdir(parents=True)
    (run / ".hf_model.old.a8b7c6d5" / "hf_model" / "model.safetensors").write_bytes(b"an earlier model")
    (run / "hf_model").mkdir()
    (run / "hf_model" / "stale.txt").write_text("an earlier export")
    recorded = trainer.record_routing

    def files_gone(*args):
        for name in hf_model.TOKENIZER_FILES:
            (folder / name).unlink(missing_ok=True)
        return recorded(*args)

    monkeypatch.setattr(trainer, "record_routing", files_gone)
    assert _train(tmp_path, folder) == 0
    assert not hf_model.has_tokenizer(folder)
    assert (run / "hf_model" / "tokenizer.json").is_file() and not (run / "hf_model" / "stale.txt").exists()
    assert _hidden(run) == []


def test_a_full_disk_during_the_export_is_the_disk_full_line_and_keeps_the_previous_model(tmp_path, stderr,
                                                                                          monkeypatch):
    """safetensors reports ENOSPC as a SafetensorError quoting the OS error; the model file is half
    written when it comes."""
    from safetensors import SafetensorError

    def disk_full(state, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 64)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", disk_full)
    folder = model_folder(tmp_path / "m", "mixtral")
    run = tmp_path / "run"
    (run / "hf_model").mkdir(parents=True)
    (run / "hf_model" / "model.safetensors").write_bytes(b"the previous model")
    stderr.readouterr()
    rc = _train(tmp_path, folder)
    err = stderr.readouterr().err
    assert rc == 1 and err.splitlines()[-1] == (f"dist-moe: error: no space left on the device ({run / 'hf_model'}); "
                                                "free space and resume with train.resume=true"), err
    assert "Traceback" not in err and "SafetensorError" not in err
    assert (run / "hf_model" / "model.safetensors").read_bytes() == b"the previous model"
    assert _hidden(run) == []


def test_every_rank_ends_as_the_main_ranks_export_did():
    """A rank other than the writer raises the writer's error at once, of the same kind: a full disk is the
    disk-full line and exit 1 on every rank, a refusal exit 2."""
    from tests.faults.hf_export_ranks import export_on_two_ranks
    from tests.support.dist_utils import run_cases

    full = "no space left on the device (/run/hf_model); free space and resume with train.resume=true"
    nan = "not writing the trained model to /run/hf_model: 'x' holds NaN or Inf (nothing was written)"
    denied = "writing the trained model to /run/hf_model failed: [Errno 13] Permission denied: '/run/hf_model'"
    run_cases(2, [(export_on_two_ranks, "full", (full, 1), (full, 1)),
                  (export_on_two_ranks, "nan", (nan, 2), (f"rank 0: {nan}", 2)),
                  (export_on_two_ranks, "denied", (denied, 2), (f"rank 0: {denied}", 2))])


@pytest.mark.parametrize("killed", ["in the swap", "after the export"])
def test_resuming_a_run_without_checkpoints_killed_at_its_end_finishes_the_export_instead_of_retraining(
        tmp_path, capsys, killed):
    """configs/hf_mixtral.yaml keeps no checkpoints: a kill in the final swap leaves the trained model complete in
    the hidden folder it waits in (or, a moment later, in place before the summary is written). train.resume=true
    puts it in place and says so, exit 0; it neither trains again nor touches the run's metrics."""
    folder = model_folder(tmp_path / "m", "mixtral")
    run = tmp_path / "run"
    assert _train(tmp_path, folder) == 0
    (run / "summary.json").unlink()  # a kill before the summary, which closes a run
    if killed == "in the swap":  # between the two renames of a first export
        (run / "hf_model").rename(run / ".hf_model.new")
    metrics = (run / "metrics.jsonl").read_bytes()
    model = {p.name: p.read_bytes() for p in (run / ("hf_model" if killed != "in the swap" else ".hf_model.new"))
             .iterdir()}
    capsys.readouterr()
    assert _train(tmp_path, folder, "train.resume=true") == 0
    out = capsys.readouterr().out
    assert f"its trained model is in {run / 'hf_model'}; nothing left to train" in out, out
    assert {p.name: p.read_bytes() for p in (run / "hf_model").iterdir()} == model
    assert (run / "metrics.jsonl").read_bytes() == metrics and _hidden(run) == []
    shutil.rmtree(run / "hf_model")  # killed while training: nothing exported, nothing to resume from
    assert _train(tmp_path, folder, "train.resume=true") == 2
    assert "no checkpoint to continue from" in capsys.readouterr().err
