"""BRANCH-MoE invariants from branch-moe-paper.txt section 3."""
import math

import pytest
import torch

from dist_moe.routing import BranchRouter, SwitchRouter

H = 6


def reference_leaf_masks(router: BranchRouter, x: torch.Tensor, anchors=None):
    """Node-by-node transcription of eq. 5-12 (a Python loop over nodes, unlike the router).

    Returns leaf masks and the per-node live anchors. ``anchors`` given -> inference path.
    """
    f = router.node_scores(x.float())
    E, D = router.num_experts, router.depth
    node_mask = {0: torch.ones(x.shape[0])}
    live = {}
    for d in range(D):
        for j in range(2**d):
            n = 2**d - 1 + j
            m = node_mask[n]
            if anchors is None:
                w = m.detach() / m.detach().sum()
                a = (w * f[:, n]).sum()
                live[n] = a
            else:
                a = anchors[n]
            p = torch.sigmoid(f[:, n] - a)
            node_mask[2 * n + 1] = m * (1 - p)  # left child (d+1, 2j)
            node_mask[2 * n + 2] = m * p  # right child (d+1, 2j+1)
    leaves = torch.stack([node_mask[E - 1 + e] for e in range(E)], dim=1)
    return leaves, live


@pytest.mark.parametrize("node_map, mlp_hidden", [("linear", None), ("mlp", 3)])
def test_matches_node_by_node_reference_forward_and_backward(node_map, mlp_hidden):
    router = BranchRouter(H, 16, 4, node_map=node_map, mlp_hidden=mlp_hidden).train()
    x = torch.randn(64, H)
    ref, live = reference_leaf_masks(router, x)
    w = torch.randn(64, 16)
    g_ref = torch.autograd.grad((ref * w).sum(), list(router.parameters()))
    r = router(x)
    assert torch.allclose(r.probs, ref, atol=1e-6)
    g = torch.autograd.grad((r.probs * w).sum(), list(router.parameters()))
    # Equal gradients prove the arrival weights are detached exactly as in the paper (eq. 19).
    for a, b in zip(g, g_ref):
        assert torch.allclose(a, b, atol=1e-5)
    # first training step: EMA anchor == batch statistic (alpha_1 = min(alpha, 0) = 0)
    assert torch.allclose(router.anchors, torch.stack([live[n] for n in range(15)]).detach(), atol=1e-6)
    router.eval()
    ref_eval, _ = reference_leaf_masks(router, x, anchors=router.anchors)
    assert torch.allclose(router(x).probs, ref_eval, atol=1e-6)


def test_rows_sum_to_one_and_masses_conserved():
    router = BranchRouter(H, 32, 4).train()
    r = router(torch.randn(100, H) * 3)
    assert torch.allclose(r.probs.sum(1), torch.ones(100), atol=1e-6)
    # sibling leaves sum to their parent's mass at every level (mass conservation, eq. 10)
    m = r.probs
    while m.shape[1] > 1:
        m = m.reshape(100, -1, 2).sum(-1)
        assert torch.allclose(m.sum(1), torch.ones(100), atol=1e-6)


@pytest.mark.parametrize("node_map, mlp_hidden", [("linear", None), ("mlp", 4)])
def test_centered_logit_identity_every_node(node_map, mlp_hidden):
    """eq. 14: sum_b omega_j(x_b) z_j(x_b) = 0 at every node in training."""
    router = BranchRouter(H, 16, 2, node_map=node_map, mlp_hidden=mlp_hidden).train()
    x = torch.randn(200, H) + 5.0  # a common offset must not matter
    _, live = reference_leaf_masks(router, x)
    r = router(x)
    f = router.node_scores(x)
    # arrival masks per node from the router's own leaf masks (sum of leaves below each node)
    for d in range(router.depth):
        width = 16 >> d
        arrival = r.probs.detach().reshape(200, 2**d, width).sum(-1)
        for j in range(2**d):
            n = 2**d - 1 + j
            w = arrival[:, j] / arrival[:, j].sum()
            z = f[:, n] - live[n]
            assert abs(float((w * z).sum().detach())) < 1e-4 * (1 + float(z.detach().abs().mean()))


def test_ema_recursion_with_warmup_cap():
    router = BranchRouter(H, 8, 2, ema_decay=0.7).train()
    batches = [torch.randn(50, H) for _ in range(6)]  # t = 4, 5, 6 run at the constant decay 0.7
    nu = torch.zeros(7)
    for t, xb in enumerate(batches, start=1):
        _, live = reference_leaf_masks(router, xb)
        stat = torch.stack([live[n] for n in range(7)]).detach()
        alpha = min(0.7, (t - 1) / t)
        nu = alpha * nu + (1 - alpha) * stat
        router(xb)
        assert int(router.ema_step) == t
        assert torch.allclose(router.anchors, nu, atol=1e-6)


def test_eval_routing_independent_of_batch_and_state_frozen():
    router = BranchRouter(H, 16, 4).train()
    for _ in range(3):
        router(torch.randn(64, H))
    router.eval()
    anchors = router.anchors.clone()
    x = torch.randn(10, H)
    alone = router(x)
    mixed = router(torch.cat([x, 100 * torch.randn(500, H)]))
    assert torch.allclose(alone.probs, mixed.probs[:10], atol=1e-7)
    assert torch.equal(alone.expert_idx, mixed.expert_idx[:10])
    assert torch.equal(router.anchors, anchors)
    # and training routing does depend on the batch (live statistic)
    router.train()
    with router.frozen_state():
        a = router(x).probs
        b = router(torch.cat([x, 100 * torch.randn(500, H)])).probs[:10]
    assert not torch.allclose(a, b, atol=1e-3)
    assert torch.equal(router.anchors, anchors)


def test_gates_eta_rule():
    x = torch.randn(30, H)
    k1 = BranchRouter(H, 16, 1).train()  # eta = 0: path probabilities kept
    r = k1(x)
    assert k1.eta == 0
    assert torch.allclose(r.gates[:, 0], r.probs.max(1).values)
    assert (r.gates < 1).all()
    k4 = BranchRouter(H, 16, 4).train()  # eta = 1: renormalised over the top-4
    r = k4(x)
    sel = r.probs.gather(1, r.expert_idx)
    assert torch.allclose(r.gates, sel / sel.sum(1, keepdim=True), atol=1e-6)
    assert torch.equal(r.expert_idx, torch.sort(r.probs, dim=1, descending=True, stable=True).indices[:, :4])
    forced = BranchRouter(H, 16, 4, eta=0).train()
    forced.load_state_dict(k4.state_dict())
    r0 = forced(x)
    assert torch.allclose(r0.gates, r0.probs.gather(1, r0.expert_idx))


def test_bf16_inputs_route_in_fp32():
    router = BranchRouter(H, 16, 4).eval()
    x = torch.randn(40, H).bfloat16()
    r = router(x)
    assert r.probs.dtype == torch.float32 and r.gates.dtype == torch.float32
    assert torch.allclose(r.probs, router(x.float()).probs)


def test_underflow_guard_skips_starved_nodes():
    """Nodes whose pre-clamp arrival mass is zero keep their anchor; the others follow eq. 7."""
    router = BranchRouter(H, 8, 2, ema_decay=0.9).train()
    router.anchors.copy_(torch.arange(7.0))
    router.ema_step.fill_(5)  # alpha_t = min(0.9, 5/6) = 0.8333
    stat = torch.full((7,), 10.0)
    mass = torch.tensor([4.0, 2.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    stat[4] = float("nan")  # 0/0 at a starved node must not leak in either
    router._update_anchors(stat, mass)
    alpha = 5 / 6
    expected = torch.arange(7.0)
    upd = mass > 0
    expected[upd] = alpha * expected[upd] + (1 - alpha) * 10.0
    assert torch.allclose(router.anchors, expected)


def test_empty_batch_and_deep_bf16_tree_stay_finite():
    """A rank with zero tokens, and a deep tree with saturated splits on bf16 inputs."""
    router = BranchRouter(H, 1024, 2, ema_decay=0.5).train()
    router.anchors.fill_(3.0)
    r = router(torch.randn(0, H).bfloat16())
    assert r.probs.shape == (0, 1024) and r.expert_idx.shape == (0, 2)
    assert torch.all(router.anchors == 3.0)  # every node starved: nothing moves
    assert int(router.ema_step) == 0  # and the warmup clock does not start on an empty batch
    with torch.no_grad():
        router.node_map.weight.mul_(400.0)  # margins of hundreds: sigmoid(-z) underflows to exactly 0
    x = torch.randn(8, H).bfloat16()
    r = router(x)
    assert (r.probs == 0).float().mean() > 0.5  # most leaf masses underflowed to zero ...
    assert torch.isfinite(r.probs).all() and torch.isfinite(router.anchors).all()
    assert torch.allclose(r.probs.sum(1), torch.ones(8), atol=1e-5)  # ... yet every row still sums to 1
    assert torch.isfinite(r.gates).all()
    router.eval()
    assert torch.isfinite(router(x).probs).all()


@torch.no_grad()
def test_anti_collapse_under_common_offset():
    """Root split stays within [1/(2e), 1 - 1/(2e)] (Corollary 4.5) where a flat softmax collapses."""
    torch.manual_seed(1)
    x = torch.randn(2000, H) + 50.0  # large common offset, log-concave (Gaussian) spread
    lo, hi = 1 / (2 * math.e), 1 - 1 / (2 * math.e)
    tree = BranchRouter(H, 16, 4).train()
    r = tree(x)
    right = r.probs.detach()[:, 8:].sum(1).mean()
    assert lo <= float(right) <= hi
    # after the EMA has tracked the statistic, inference also splits the root within bounds
    tree.eval()
    right_eval = tree(x).probs[:, 8:].sum(1).mean()
    assert lo <= float(right_eval) <= hi
    # the same tree without anchors (a = 0) sends (nearly) all mass to one side of the root
    with torch.no_grad():
        tree.anchors.zero_()
    unanchored = float(tree(x).probs[:, 8:].sum(1).mean())
    assert unanchored < 0.01 or unanchored > 0.99
    # a flat softmax router without anchors collapses onto one expert
    flat = SwitchRouter(H, 16, 4, jitter_eps=0.0).train()
    mass = flat(x).probs.mean(0)
    assert float(mass.max()) > 0.9
    # while every leaf of the tree keeps mean mass above the (2e)^-D floor of eq. 34 (no starvation)
    assert float(r.probs.mean(0).min()) >= (2 * math.e) ** -4


def test_power_of_two_and_eta_validation():
    with pytest.raises(ValueError, match="power of two"):
        BranchRouter(H, 6, 2)
    with pytest.raises(ValueError, match="eta"):
        BranchRouter(H, 8, 2, eta=0.5)
