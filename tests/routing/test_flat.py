"""Flat baselines: Switch, DeepSeek-V3, Skywork, hash, uniform, and capacity."""
import math

import pytest
import torch

from dist_moe.routing import DeepSeekV3Router, HashRouter, SkyworkRouter, SwitchRouter, UniformRouter, build_router
from dist_moe.routing.capacity import apply_capacity, capacity_for

H, E = 8, 8


def test_switch_aux_loss_formula():
    router = SwitchRouter(H, E, top_k=2, jitter_eps=0.0).train()
    x = torch.randn(64, H)
    r = router(x)
    probs = torch.softmax(router.node_map(x), -1)
    counts = torch.zeros(E)
    for row in r.expert_idx:
        counts[row] += 1
    f = counts / (64 * 2)
    expected = 0.01 * E * (f * probs.mean(0)).sum()
    assert torch.allclose(r.aux_loss, expected, atol=1e-7)
    # perfectly uniform routing gives exactly the coefficient
    uniform = torch.full((E, E), 1.0 / E)
    from dist_moe.routing.flat import switch_aux_loss

    assert math.isclose(float(switch_aux_loss(uniform, torch.arange(E).unsqueeze(1), 0.01)), 0.01, rel_tol=1e-6)
    # and the aux loss has a gradient into the router
    r.aux_loss.backward()
    assert router.node_map.weight.grad.abs().sum() > 0


def test_switch_jitter_only_in_training():
    router = SwitchRouter(H, E, top_k=1, jitter_eps=0.5)
    x = torch.randn(16, H)
    router.eval()
    assert torch.equal(router(x).probs, router(x).probs)
    router.train()
    assert not torch.equal(router(x).probs, router(x).probs)


def test_capacity_priority_and_drop_count():
    # 4 tokens, all first choices on expert 0; capacity 2 per expert
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 1]])
    gates = torch.full((4, 2), 0.5)
    new_idx, new_gates, dropped = apply_capacity(idx, gates, 3, capacity=2)
    # first choices are served first, in token order: tokens 0 and 1 keep expert 0
    assert new_idx[:, 0].tolist() == [0, 0, -1, -1]
    # second choices: expert 1 takes tokens 0 and 2, token 3 overflows; expert 2 takes token 1
    assert new_idx[:, 1].tolist() == [1, 2, 1, -1]
    assert dropped == 3
    assert torch.equal(new_gates == 0, new_idx == -1)
    assert capacity_for(10, 2, 4, 1.25) == math.ceil(1.25 * 10 * 2 / 4)


def test_switch_capacity_reports_dropped():
    router = SwitchRouter(H, E, top_k=2, capacity_factor=0.25, jitter_eps=0.0).train()
    r = router(torch.randn(100, H))
    cap = capacity_for(100, 2, E, 0.25)
    assert r.stats["capacity"] == cap
    assert r.stats["dropped"] == int((r.expert_idx == -1).sum()) > 0
    kept = r.expert_idx[r.expert_idx >= 0]
    assert torch.bincount(kept, minlength=E).max() <= cap


def test_deepseek_bias_selection_only_and_update_direction():
    router = DeepSeekV3Router(H, E, top_k=2, bias_update_rate=0.1).train()
    x = torch.randn(200, H)
    with router.frozen_state():
        before = router(x)
    assert torch.equal(router.expert_bias, torch.zeros(E))
    r = router(x)  # training forward moves the bias once, after selecting with the old bias
    assert torch.equal(r.expert_idx, before.expert_idx)
    load = r.stats["load"]
    expected = 0.1 * torch.sign(load.mean() - load)
    assert torch.allclose(router.expert_bias, expected)
    # a large bias changes which experts are selected, but gates stay the unbiased affinities
    router.expert_bias.zero_()
    router.expert_bias[3] = 100.0
    with router.frozen_state():
        r = router(x)
    assert (r.expert_idx == 3).any(1).all()
    scores = torch.sigmoid(router.node_map(x))
    # the set comes from the biased scores, the order from the unbiased ones (highest first)
    sel_scores = scores.gather(1, r.expert_idx)
    assert (sel_scores[:, :-1] >= sel_scores[:, 1:]).all()
    sel = scores.gather(1, r.expert_idx)
    assert torch.allclose(r.gates, sel / sel.sum(1, keepdim=True), atol=1e-6)
    assert r.aux_loss.item() == 0.0


def test_deepseek_balances_load_without_aux_loss():
    torch.manual_seed(3)
    router = DeepSeekV3Router(H, E, top_k=2, bias_update_rate=0.01).train()
    x = torch.randn(512, H) + 2.0  # offset: skewed affinities
    with router.frozen_state():
        cv0 = router(x).stats["load"].std(unbiased=False) / (512 * 2 / E)
    for _ in range(300):
        router(x)
    with router.frozen_state():
        cv1 = router(x).stats["load"].std(unbiased=False) / (512 * 2 / E)
    assert cv1 < 0.25 * cv0


def test_deepseek_eval_does_not_move_bias():
    router = DeepSeekV3Router(H, E, top_k=2).eval()
    router(torch.randn(20, H))
    assert torch.equal(router.expert_bias, torch.zeros(E))


def test_skywork_normalises_logits():
    router = SkyworkRouter(H, E, top_k=2, norm_scale=2.0, jitter_eps=0.0).eval()
    x = torch.randn(50, H) * 10
    z = router.logits(x)
    assert torch.allclose(z.mean(-1), torch.zeros(50), atol=1e-5)
    assert torch.allclose(z.std(-1, unbiased=False), torch.full((50,), 2.0), atol=1e-4)
    r = router(x)
    assert torch.allclose(r.probs, torch.softmax(z, -1))
    from dist_moe.routing.flat import switch_aux_loss

    assert torch.allclose(r.aux_loss, switch_aux_loss(torch.softmax(z, -1), r.expert_idx, 0.01))


def test_hash_router_fixed_distinct_and_balanced():
    router = HashRouter(E, top_k=3, seed=7)
    x = torch.randn(4000, H)
    ids = torch.randint(0, 10**9, (4000,))
    a = router(x, token_ids=ids)
    b = router(torch.randn(4000, H), token_ids=ids)  # content is ignored: same ids, same experts
    assert torch.equal(a.expert_idx, b.expert_idx)
    assert all(len(set(row.tolist())) == 3 for row in a.expert_idx[:200])
    assert torch.allclose(a.gates, torch.full((4000, 3), 1 / 3))
    load = a.stats["load"]
    assert float(load.std(unbiased=False) / load.mean()) < 0.06  # 12,000 draws over 8 experts
    # no ids: position is the key
    c = router(x[:10])
    assert torch.equal(c.expert_idx, router(x[:10], token_ids=torch.arange(10)).expert_idx)
    # another seed gives another hash
    assert not torch.equal(HashRouter(E, 3, seed=8)(x, token_ids=ids).expert_idx, a.expert_idx)


def test_uniform_router_dense_equal_weights():
    r = UniformRouter(E)(torch.randn(5, H))
    assert torch.allclose(r.gates, torch.full((5, E), 1 / E))
    assert sorted(r.expert_idx[0].tolist()) == list(range(E))


@pytest.mark.parametrize("kind", ["switch", "deepseek_v3", "skywork", "hash", "uniform", "branch"])
def test_zero_tokens(kind):
    cfg = {"type": kind, "num_experts": E, "top_k": E if kind == "uniform" else 2}
    if kind not in ("hash", "uniform"):
        cfg["hidden_size"] = H
    router = build_router(cfg).train()
    r = router(torch.randn(0, H))
    assert r.expert_idx.shape == (0, router.top_k) and torch.isfinite(r.aux_loss)
    assert r.stats["load"].sum() == 0


@pytest.mark.parametrize("kind", ["switch", "deepseek_v3", "skywork"])
@pytest.mark.parametrize("limit, k", [(1, 2), (2, 4)])
def test_node_limited_routing(kind, limit, k):
    router = build_router({"type": kind, "hidden_size": H, "num_experts": 16, "top_k": k, "node_limit": limit})
    x = torch.randn(300, H)
    with pytest.raises(ValueError, match="expert groups"):
        router(x)
    groups = torch.arange(16) % 4  # 4 nodes of 4 experts, interleaved ids (a non-contiguous placement)
    router.set_expert_groups(groups)
    r = router.eval()(x)
    spans = torch.tensor([len(set(groups[row].tolist())) for row in r.expert_idx])
    assert (spans <= limit).all() and (spans == limit).any()
    # the chosen groups are those with the largest sum of their top ceil(K/M) scores
    if kind != "deepseek_v3":
        take = -(-k // limit)
        per_group = torch.stack([r.probs[:, groups == g].topk(take, -1).values.sum(-1) for g in range(4)], 1)
        best = per_group.topk(limit, -1).indices.sort(-1).values
        chosen = torch.stack([groups[row].unique() for row in r.expert_idx]) if limit == 1 else None
        if chosen is not None:
            assert torch.equal(chosen.flatten(), best.flatten())
    # selected experts are still ordered by probability, highest first
    sel = r.probs.gather(1, r.expert_idx)
    assert (sel[:, :-1] >= sel[:, 1:]).all()
    unlimited = build_router({"type": kind, "hidden_size": H, "num_experts": 16, "top_k": k, "node_limit": 4})
    unlimited.load_state_dict(router.state_dict())
    unlimited.set_expert_groups(groups)
    free = build_router({"type": kind, "hidden_size": H, "num_experts": 16, "top_k": k})
    free.load_state_dict(router.state_dict(), strict=False)
    assert torch.equal(unlimited.eval()(x).expert_idx, free.eval()(x).expert_idx)
    with pytest.raises(ValueError, match="cannot fit"):
        build_router({"type": kind, "hidden_size": H, "num_experts": 16, "top_k": 6, "node_limit": 1}
                     ).set_expert_groups(groups)


@pytest.mark.parametrize("k", [1, 2])
def test_deepseek_top1_router_trains_and_normalises_only_above_one(k):
    """Megatron-core normalises sigmoid top-k scores only when k > 1; a normalised single gate
    is always 1.0 and the router's weight would get no gradient."""
    torch.manual_seed(0)
    r = DeepSeekV3Router(8, 4, top_k=k)
    x = torch.randn(16, 8)
    out = r(x)
    (out.gates * torch.randn_like(out.gates)).sum().backward()
    assert r.normalize_gates == (k > 1)
    assert r.node_map.weight.grad.abs().sum() > 0
    pytest.importorskip("megatron.core")
    from dist_moe.integrations.megatron import patches as megatron_patches

    megatron_patches.apply()
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    # Megatron's own routing on the same logits is the reference (bias zero: selection unchanged)
    probs, routing_map = topk_routing_with_score_function(x @ r.node_map.weight.detach().t(), k,
                                                          score_function="sigmoid", expert_bias=torch.zeros(4))
    assert torch.equal(routing_map, out.dense_gates() != 0)
    assert torch.allclose(out.dense_gates().detach(), probs, atol=1e-6)
