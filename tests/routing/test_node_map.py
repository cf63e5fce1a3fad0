"""The mlp node map's hidden units ([T, outputs, mlp_hidden], a GiB at T 16k) are made a chunk of tokens at a
time and recomputed in backward: scores and every gradient equal the plain two-einsum formula's (fp32), and
the forward keeps nothing token-sized but its input."""
import torch

import dist_moe.routing.node_map as node_map
from dist_moe.routing.node_map import NodeMap


def _plain(m: NodeMap, x):
    hid = torch.relu(torch.einsum("th,nkh->tnk", x, m.U) + m.c)
    return torch.einsum("tnk,nk->tn", hid, m.v)


def test_chunked_mlp_scores_and_gradients_equal_the_formula(monkeypatch):
    torch.manual_seed(0)
    m = NodeMap(12, 7, "mlp", mlp_hidden=5)
    x = torch.randn(50, 12)
    w = torch.randn(50, 7)
    monkeypatch.setattr(node_map, "MLP_CHUNK_BYTES", 4 * 7 * 5 * 16)  # 16 tokens a chunk: 4 chunks, the last short
    results = []
    for fn in (m, lambda x: _plain(m, x)):
        xi = x.clone().requires_grad_()
        (fn(xi) * w).sum().backward()
        results.append([fn(x).detach(), xi.grad, *(p.grad.clone() for p in (m.U, m.c, m.v))])
        m.zero_grad(set_to_none=True)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert m(x[:0]).shape == (0, 7)


def test_the_forward_keeps_no_hidden_units():
    m = NodeMap(16, 15, "mlp", mlp_hidden=8)
    x = torch.randn(64, 16, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        m(x)
    assert kept and max(t.numel() for t in kept) < 64 * 15 * 8, [tuple(t.shape) for t in kept]
