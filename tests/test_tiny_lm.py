"""The tiny multi-domain MoE LM: the corpus, training, and expert parallelism equal to one process."""
import pytest
import torch

from dist_moe import MoELayer
from dist_moe.models.tiny_lm import TinyMoELM, lm_loss
from tests.dist_utils import run_workers

corpus = pytest.importorskip("dist_moe.train.corpus")
HAVE_CORPUS = corpus.FORTUNES.joinpath("fortunes").exists() and corpus.WORDNET.joinpath("data.noun").exists()
needs_corpus = pytest.mark.skipif(not HAVE_CORPUS, reason="Debian fortunes-min and wordnet-base not installed "
                                                          "(make installs them when run as root)")
D = 32


@needs_corpus
def test_corpus_has_four_balanced_domains(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path))
    c = corpus.load_corpus(seq_len=32, per_domain=300)
    assert c.tokens.shape == (1200, 33) and c.tokens.dtype == torch.uint8
    assert c.domain.bincount().tolist() == [300, 300, 300, 300]
    code = bytes(c.tokens[c.domain == 3][0].tolist())
    assert code.decode("utf-8", errors="replace")  # Python source bytes
    again = corpus.load_corpus(seq_len=32, per_domain=300)  # from the cache
    assert torch.equal(again.tokens, c.tokens)


@needs_corpus
def test_lm_learns_with_domain_routing(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path))
    c = corpus.load_corpus(seq_len=32, per_domain=300)
    torch.manual_seed(0)
    router = {"type": "specdrop", "num_experts": 4, "num_categories": 4, "p_assigned": 0.7}
    model = TinyMoELM(lambda i: MoELayer(D, 64, dict(router)), d_model=D)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        rows = torch.arange(step * 16, step * 16 + 16) % len(c.tokens)
        x, y = c.tokens[rows, :-1].long(), c.tokens[rows, 1:].long()
        logits, aux = model(x, c.domain[rows])
        loss = lm_loss(logits, y)
        opt.zero_grad()
        (loss + aux).backward()
        opt.step()
        losses.append(float(loss))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0  # from ~5.5 nats (uniform bytes) downwards


def _ep_worker(rank, world, router):
    import torch.distributed as dist

    from placement import Placement

    torch.manual_seed(0)
    ref = TinyMoELM(lambda i: MoELayer(D, 48, dict(router)), d_model=D)
    placement = Placement.round_robin(8, world)
    ep = TinyMoELM(lambda i: MoELayer(D, 48, dict(router), placement=placement, group=dist.group.WORLD,
                                      dedup="node" if world == 4 else "rank"), d_model=D)
    state = {k: v for k, v in ref.state_dict().items() if ".experts." not in k}
    ep.load_state_dict(state, strict=False)
    for b_ref, b_ep in zip(ref.blocks, ep.blocks):
        for name, p in b_ep.moe.experts.named_parameters():
            p.data.copy_(getattr(b_ref.moe.experts, name).data[b_ep.moe.local_expert_ids])
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (4 * world, 12), generator=g)
    cats = torch.randint(0, 4, (4 * world,), generator=g)
    mine = slice(4 * rank, 4 * rank + 4)
    y_ref, _ = ref(x, cats)
    y, _ = ep(x[mine], cats[mine])
    assert torch.allclose(y, y_ref[mine], atol=1e-4), (router["type"], float((y - y_ref[mine]).abs().max()))


@pytest.mark.parametrize("world,router", [
    (2, {"type": "specdrop", "num_experts": 8, "num_categories": 4, "p_assigned": 0.6}),
    (2, {"type": "hash", "num_experts": 8, "top_k": 2}),
    (4, {"type": "switch", "num_experts": 8, "top_k": 2, "jitter_eps": 0.0}),
])
def test_expert_parallel_lm_equals_one_process(world, router):
    run_workers(_ep_worker, world, args=(router,), timeout=120)
