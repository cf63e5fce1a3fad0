"""``model.kind: hf`` in one process: a transformers MoE model whose experts dist-moe hosts computes what
transformers computes (logits and every gradient, to 1e-5), exports what ``from_pretrained`` reads back
exactly, tokenizes a text with the model folder's tokenizer, and every bad model or config is refused
in one line before a run starts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_moe.cli import main
from dist_moe.data.local_text import local_split
from dist_moe.dispatch.exchange import ExchangeConfig
from dist_moe.integrations.transformers.hosted import HostedHFExperts, host_experts
from dist_moe.models.hf_model import HFCausalLM, load_model, load_tokenizer
from placement import Placement, Topology
from tests.support.hf_models import KINDS, config, model_folder, text, word_tokenizer

pytest.importorskip("transformers", reason="transformers is not installed")


@pytest.fixture(autouse=True)
def _data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path / "data"))


def _hosted(folder: Path):
    model = load_model(folder, 0)
    hosts = host_experts(model, lambda e: Placement.contiguous(e, 1), Topology.launched(1), None, ExchangeConfig())
    return model, hosts


@pytest.mark.parametrize("kind", KINDS)
def test_hosted_experts_compute_what_transformers_computes(kind, tmp_path):
    folder = model_folder(tmp_path / kind, kind, weights=True)
    own = load_model(folder, 0)
    model, hosts = _hosted(folder)
    assert hosts and all(isinstance(h, HostedHFExperts) for h in hosts)
    assert set(own.state_dict()) == set(model.state_dict())  # transformers' keys, unchanged
    tokens = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(1))
    want = own(input_ids=tokens, labels=tokens)
    logits, aux = HFCausalLM(model, folder)(tokens)
    torch.testing.assert_close(logits, want.logits, atol=1e-5, rtol=1e-5)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 300), tokens[:, 1:].reshape(-1)) + aux
    torch.testing.assert_close(loss, want.loss, atol=1e-5, rtol=1e-5)  # aux: the model's own router loss
    want.loss.backward()
    loss.backward()
    grads = dict(model.named_parameters())
    for name, p in own.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, atol=1e-5, rtol=1e-5, msg=name)
    assert hosts[0].last_routing.expert_idx.shape == (48, 2)


@pytest.mark.parametrize("tied", [False, True])
def test_export_is_what_from_pretrained_reads_back(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    folder = model_folder(tmp_path / "m", "qwen3_moe", weights=True, tokenizer_text=text(20), tied=tied)
    model, _ = _hosted(folder)
    wrapped = HFCausalLM(model, folder, load_tokenizer(folder))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.txt").write_text("an earlier export")  # replaced whole
    wrapped.write(wrapped.export_state(True), tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, t in load_model(folder, 0).state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    assert (tmp_path / "out" / "tokenizer.json").is_file() and not (tmp_path / "out" / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(ValueError, match="is a symbolic link"):
        wrapped.write(wrapped.export_state(True), tmp_path / "link")


@pytest.mark.parametrize("piece", [1 << 20, 100])  # one call per file, or many cut at line ends
def test_text_is_tokenized_by_the_model_folders_tokenizer(tmp_path, monkeypatch, piece):
    monkeypatch.setattr("dist_moe.data.local_text.TOKENIZE_CHUNK", piece)
    words = text(60)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(words[:1000])
    (tmp_path / "docs" / "b.txt").write_text(words[1000:])
    folder = model_folder(tmp_path / "m", "mixtral", tokenizer_text=words)
    tok = word_tokenizer(words)
    split = local_split(str(tmp_path / "docs"), 7, 0.25, 0, len(tok), tokenizer=folder)
    eos = tok.eos_token_id
    stream = tok(words[:1000])["input_ids"] + [eos] + tok(words[1000:])["input_ids"] + [eos]
    rows = torch.cat([torch.cat([split.x_train[:], split.y_train[:, -1:]], 1),
                      torch.cat([split.x_val[:], split.y_val[:, -1:]], 1)])
    want = sorted(stream[i * 8:(i + 1) * 8] for i in range(len(stream) // 8))
    assert sorted(rows.tolist()) == want


def _train(tmp_path, *args) -> int:
    return main(["train", "--quiet", f"output.dir={tmp_path / 'run'}", "train.max_steps=2", "data.seq_len=16",
                 "train.batch_size=4", *args])


def test_dist_moe_train_trains_a_users_model_folder_on_its_text_in_one_command(tmp_path):
    from transformers import AutoModelForCausalLM

    (tmp_path / "mine.txt").write_text(text(300))
    folder = model_folder(tmp_path / "m", "mixtral", tokenizer_text=text(300))  # config only: random weights
    assert _train(tmp_path, "model.kind=hf", f"model.path={folder}", f"data.name={tmp_path / 'mine.txt'}",
                  "train.max_steps=40", "train.log_every=10", "train.lr=3e-3") == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if "loss" in r]
    assert losses[-1] < losses[0] - 0.5
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["router"] == "MixtralTopKRouter" and summary["hf_model"] == str(tmp_path / "run" / "hf_model")
    assert (summary["num_experts"], summary["top_k"], summary["random_pair_tree_distance"]) == (8, 2, None)
    back = AutoModelForCausalLM.from_pretrained(summary["hf_model"])
    assert back.config.num_local_experts == 8 and (tmp_path / "run" / "hf_model" / "tokenizer.json").is_file()


@pytest.mark.parametrize("case,args,message", [
    ("no path", ["model.kind=hf"], "model.kind=hf needs model.path"),
    ("path alone", ["model.path=M"], "is read by model.kind=hf only (model.kind is 'tabular')"),
    ("engine", ["model.kind=hf", "model.path=M", "engine=deepspeed"], "set engine: torch"),
    ("router", ["model.kind=hf", "model.path=M", "router.type=switch"],
     "router.type (given by override 'router.type=switch'): model.kind=hf routes with the model's own router"),
    ("built-in data", ["model.kind=hf", "model.path=M", "data.name=corpus"], "data.name='corpus' is none"),
    ("no config", ["model.kind=hf", "model.path=EMPTY", "data.name=T"], "must be a transformers model folder"),
    ("pickles", ["model.kind=hf", "model.path=PICKLED", "data.name=T"],
     "holds weights dist-moe does not load (pytorch_model.bin"),
    ("dense", ["model.kind=hf", "model.path=DENSE", "data.name=T"], "without MoE blocks dist-moe can host"),
    ("vocab", ["model.kind=hf", "model.path=SMALL", "data.name=T"], "the model reads ids below 64 (text as bytes)"),
    ("unknown", ["model.kind=hf", "model.path=ALIEN", "data.name=T"], "transformers cannot read its config.json"),
    ("other weights", ["model.kind=hf", "model.path=PTH", "data.name=T"], "holds weights dist-moe does not load"),
    ("partial", ["model.kind=hf", "model.path=PARTIAL", "data.name=T"], "its weights do not fit its config.json"),
    ("quantized", ["model.kind=hf", "model.path=QUANT", "data.name=T"], "is a quantized checkpoint"),
    ("too long", ["model.kind=hf", "model.path=M", "data.name=T", "data.seq_len=65"],
     "longer than the model's max_position_embeddings=64"),
    ("memory", ["model.kind=hf", "model.path=M", "data.name=T", "train.batch_size=100000000"], "GiB per rank to train"),
])
def test_bad_models_and_configs_are_refused_in_one_line(tmp_path, capsys, case, args, message):
    from transformers import LlamaConfig

    (tmp_path / "t.txt").write_text(text(40))
    folders = {"M": model_folder(tmp_path / "m", "mixtral"), "EMPTY": tmp_path / "empty",
               "PICKLED": model_folder(tmp_path / "pickled", "mixtral"), "DENSE": tmp_path / "dense",
               "SMALL": model_folder(tmp_path / "small", "mixtral", vocab=64), "T": tmp_path / "t.txt",
               "ALIEN": tmp_path / "alien", "PTH": model_folder(tmp_path / "pth", "mixtral"),
               "PARTIAL": model_folder(tmp_path / "partial", "mixtral", weights=True),
               "QUANT": model_folder(tmp_path / "quant", "mixtral")}
    (tmp_path / "pth" / "model.pth").write_bytes(b"not loaded")
    _drop_a_weight(tmp_path / "partial" / "model.safetensors")
    quant = json.loads((tmp_path / "quant" / "config.json").read_text())
    quant["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "quant" / "config.json").write_text(json.dumps(quant))
    (tmp_path / "empty").mkdir()
    (tmp_path / "alien").mkdir()
    (tmp_path / "alien" / "config.json").write_text('{"model_type": "alien", "auto_map": {"AutoConfig": "x.Y"}}')
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"not loaded")
    LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2).save_pretrained(tmp_path / "dense")
    args = [a.split("=")[0] + "=" + str(folders.get(a.split("=")[1], a.split("=")[1])) for a in args]
    capsys.readouterr()  # what making the folders printed
    rc = _train(tmp_path, *args)
    # transformers' progress bar while it loads the weights may come first; then the one line
    err = "\n".join(line for line in capsys.readouterr().err.splitlines() if "it/s]" not in line)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, (case, err)
    assert not (tmp_path / "run").exists()


def _drop_a_weight(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(path)
    weights.pop(sorted(weights)[0])
    save_file(weights, path, metadata={"format": "pt"})


def test_the_hosted_layer_is_what_the_config_asks_for(tmp_path):
    folder = model_folder(tmp_path / "m", "deepseek_v3", vocab=300)
    model = load_model(folder, 0)
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj, load_model(folder, 0).model.layers[1].mlp.experts
                       .down_proj)  # random weights from the seed: the same on every rank
    assert config("deepseek_v3").n_group == 2


def test_a_rank_without_rows_still_runs_its_moe_layers_and_adds_nothing(tmp_path):
    """An epoch's last, short batch can leave a rank no rows: its MoE layers must still exchange (the
    other ranks wait for it), and nothing of the stand-in row may reach the loss."""
    folder = model_folder(tmp_path / "m", "mixtral", weights=True)
    model, hosts = _hosted(folder)
    logits, aux = HFCausalLM(model, folder)(torch.zeros(0, 16, dtype=torch.long))
    assert logits.shape == (0, 16, 300) and float(aux.detach()) == 0.0
    assert all(h.forwards == 1 for h in hosts)  # every layer ran once
    (logits.sum() + aux).backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
