"""The balanced subtree limit's rule: newton steps, their measured slopes, and evaluation's bias."""
from __future__ import annotations

import pytest
import torch

from dist_moe.routing import build_router
from placement.subtree import WINDOW, balance_slope, balance_step, limited_top_k, node_bias


def _router(**kw):
    return build_router({"type": "branch", "hidden_size": 8, "num_experts": 16, "top_k": 4, "subtree_limit": 1,
                         "subtree_depth": 1, **kw})


def test_newton_step_is_the_rate_times_the_shortfall_over_the_slope_within_the_window():
    bias = torch.zeros(2 * 8 - 2)
    load = torch.tensor([6.0, 2, 2, 2, 0, 1, 1, 2])  # nodes 12 and 4: mean 8
    slope = torch.zeros(14)
    node_bias(slope, 1).copy_(torch.tensor([400.0, 40.0]))
    node_bias(slope, 3).copy_(torch.tensor([200.0, 50, 0, 50, 200, 0, 50, 50]))
    balance_step(bias, load, [(1, 1)], rate=0.5, rule="newton", slope=slope)
    # depth 1: 0.5 * (8 - 12) / 400 = -0.005; 0.5 * 4 / 40 = 0.05, the window's edge (0.1 / 2)
    assert torch.allclose(node_bias(bias, 1), torch.tensor([-0.005, 0.05]))
    # leaves (mean 2, window 0.1 / 8): 0.5 * -4 / 200; at the mean, slope 0 or not: 0; 0.5 * 2 / 200;
    # shortfall 1 with slope 0: the window's step; 0.5 * 1 / 50
    want = torch.tensor([-0.01, 0.0, 0.0, 0.0, 0.005, 0.0125, 0.01, 0.0])
    assert torch.allclose(node_bias(bias, 3), want)
    assert torch.equal(node_bias(bias, 2), torch.zeros(4))  # depth 2 is not limited: untouched


def test_newton_step_is_clipped_to_the_window_at_every_depth():
    bias = torch.zeros(2 * 16 - 2)
    load = torch.zeros(16)
    load[:4] = 100.0  # everything on the first four leaves
    balance_step(bias, load, [(1, 1), (2, 1)], rate=1.0, rule="newton", slope=torch.full((30,), 1e-3))
    for depth in (1, 2, 4):
        assert node_bias(bias, depth).abs().max() == pytest.approx(WINDOW / (1 << depth))


def test_slope_counts_the_tokens_within_the_window_of_each_cut():
    # E=4, top-1, one of two nodes; windows 0.05 (nodes) and 0.025 (leaves)
    probs = torch.tensor([[0.27, 0.25, 0.28, 0.20],  # nodes 0.52 / 0.48: near the node cut; leaves 0.02 apart
                          [0.50, 0.30, 0.10, 0.10],  # far from every cut
                          [0.10, 0.10, 0.44, 0.36],  # far from every cut
                          [0.05, 0.05, 0.46, 0.44],  # node 1 far; its leaves 0.02 apart
                          [0.40, 0.37, 0.13, 0.10]])  # leaves 0.03 apart: outside the window
    bias = torch.zeros(6)
    slope = balance_slope(probs, 1, [(1, 1)], bias)
    assert torch.allclose(node_bias(slope, 1), torch.tensor([1.0, 1.0]) / 0.1)  # one token each, over 2 x 0.05
    assert torch.allclose(node_bias(slope, 2), torch.tensor([1.0, 1, 1, 1]) / 0.05)
    valid = torch.tensor([True, True, True, False, True])  # padding counts nowhere
    assert torch.allclose(node_bias(balance_slope(probs, 1, [(1, 1)], bias, valid), 2),
                          torch.tensor([20.0, 20, 0, 0]))
    node_bias(bias, 1).copy_(torch.tensor([0.1, -0.1]))  # the bias moves the cut: token 0 is 0.24 from it
    assert torch.equal(node_bias(balance_slope(probs, 1, [(1, 1)], bias), 1), torch.zeros(2))
    # two kept subtrees of four (masses .30 .26 | .24 .20, window 0.025) carry K / M slots each
    wide = torch.tensor([[0.15, 0.15, 0.13, 0.13, 0.12, 0.12, 0.10, 0.10]])
    wide = balance_slope(wide, 4, [(2, 2)], torch.zeros(14))
    assert torch.allclose(node_bias(wide, 2), torch.tensor([0.0, 1, 1, 0]) / 0.05 * 2)


def _skewed_loads(bias, g, e=16, k=4):
    probs = torch.softmax(torch.randn(512, e, generator=g) + torch.linspace(1.5, 0.0, e), dim=1)
    idx = limited_top_k(probs, k, [(1, 1)], bias)[1]
    return probs, torch.bincount(idx.flatten(), minlength=e).float()


def test_newton_balances_skewed_scores_in_a_few_steps():
    g = torch.Generator().manual_seed(0)
    bias = torch.zeros(30)
    for _ in range(12):
        probs, load = _skewed_loads(bias, g)
        balance_step(bias, load, [(1, 1)], 0.5, "newton", balance_slope(probs, 4, [(1, 1)], bias))
    node = sum(_skewed_loads(bias, g)[1] for _ in range(5)).reshape(2, -1).sum(1)
    assert float(node.max() / node.mean()) < 1.05, node


def test_router_defaults_keys_and_state():
    r = _router()
    assert (r.balance_rule, r.balance_rate, r.balance_eval) == ("newton", 0.1, True)
    assert _router(balance_rule="sign").balance_rate == 0.01
    for kw, msg in (({"balance_rule": "quantile"}, "'balance_rule' must be one of sign, newton, got 'quantile'"),
                    ({"balance_eval": "yes"}, "'balance_eval' must be true or false, got 'yes'"),
                    ({"balance_rate": -1}, "'balance_rate' must be a number > 0, got -1")):
        with pytest.raises(ValueError, match=msg):
            _router(**kw)
    old = {k: v for k, v in r.state_dict().items() if not k.startswith("eval_balance")}
    r.eval_balance.balance_bias.fill_(1.0)
    r.load_state_dict(old)  # from before evaluation's bias: it starts at zero
    assert not r.eval_balance.balance_bias.any()
    none = _router(subtree_balance="none")
    none.load_state_dict({k: v for k, v in r.state_dict().items() if "balance" not in k or "eval" in k})
    assert "eval_balance.balance_bias" not in _router(balance_eval=False).state_dict()


def test_evaluation_selects_with_its_own_bias_moved_from_the_ema_anchors_routing():
    torch.manual_seed(0)
    r = _router()
    x = torch.randn(256, 8) * 3
    r.train()(x)
    assert r.balance_bias.any() and r.eval_balance.balance_bias.any()  # both moved by a training forward
    node_bias(r.eval_balance.balance_bias, 1).copy_(torch.tensor([-5.0, 5.0]))  # evaluation: node 1 only
    r.eval()
    assert (r(x).expert_idx >= 8).all()
    r.train()
    with r.frozen_state():
        assert (r(x).expert_idx < 8).any()  # training still selects with its own


def _one_token_at_a_time(probs, k, limits, bias, valid):
    """The selection and its slopes as their docstrings state them, token by token in Python: subtrees
    ranked by mass + bias inside the ones the level above kept, then leaves by probability + bias,
    ties to the lower index, reported by probability; every unit within its window of a cut counted."""
    t, e = probs.shape
    rows, slope = [], torch.zeros(2 * e - 2, dtype=torch.float64)

    def cut(units, score, m, h, first, weight, count):
        ranked = sorted(units, key=lambda u: (-score[u], u))
        if count and m < len(units):
            last_in, first_out = score[ranked[m - 1]], score[ranked[m]]
            for u in units:
                if (score[u] - first_out < h) if u in ranked[:m] else (last_in - score[u] < h):
                    slope[first + u] += weight / (2 * h)
        return ranked[:m]

    for i in range(t):
        p, count = probs[i].tolist(), valid is None or bool(valid[i])
        allowed = list(range(e))
        for depth, m in limits:
            n, size = 1 << depth, e >> depth
            units = sorted({leaf // size for leaf in allowed})
            shift = node_bias(bias, depth) if depth else torch.zeros(1)  # the root has no bias of its own
            score = {u: sum(p[u * size:(u + 1) * size]) + float(shift[u]) for u in units}
            kept = cut(units, score, m, WINDOW / n, n - 2, k / m, count)
            allowed = [leaf for leaf in allowed if leaf // size in kept]
        score = {leaf: p[leaf] + float(node_bias(bias, e.bit_length() - 1)[leaf]) for leaf in allowed}
        chosen = cut(allowed, score, k, WINDOW / e, e - 2, 1.0, count)
        rows.append(sorted(chosen, key=lambda leaf: -p[leaf]))  # stable: equal ones in the order chosen
    return torch.tensor(rows), slope


@pytest.mark.parametrize("e,k,limits", [(16, 4, [(1, 1)]), (16, 4, [(2, 2)]), (16, 2, [(1, 1), (2, 1)]),
                                        (32, 4, [(1, 1), (3, 2)]), (16, 4, [(2, 4)]), (8, 3, [(1, 2), (2, 2)]),
                                        (16, 4, [(0, 1), (1, 1)])])  # the root level (one node of one)
def test_one_pass_selects_and_measures_slopes_as_token_by_token(e, k, limits):
    # dyadic probabilities and biases: float32 sums are exact, and ties are everywhere
    g = torch.Generator().manual_seed(e * 10 + k)
    probs = torch.randint(0, 8, (40, e), generator=g).float() / 64
    bias = torch.randint(-2, 3, (2 * e - 2,), generator=g).float() / 64
    valid = torch.rand(40, generator=g) > 0.25
    want_idx, want_slope = _one_token_at_a_time(probs, k, limits, bias, valid)
    vals, idx = limited_top_k(probs, k, limits, bias)
    assert torch.equal(idx, want_idx) and torch.equal(vals, probs.gather(1, want_idx))
    assert torch.allclose(balance_slope(probs, k, limits, bias, valid).double(), want_slope, rtol=1e-6)
    assert limited_top_k(probs[:0], k, limits, bias)[1].shape == (0, k)  # an empty batch (a rank's padding)
    assert not balance_slope(probs[:0], k, limits, bias).any()


def test_padding_counts_in_no_balance_statistic():
    """Rows marked padding (the float mask a router gets) move neither bias nor the anchors."""
    torch.manual_seed(0)
    padded, alone = _router(), _router()
    alone.load_state_dict(padded.state_dict())
    for _ in range(3):
        x = torch.randn(96, 8) * 3
        padded(torch.cat([x, torch.randn(32, 8) * 9]), valid=torch.arange(128) < 96)
        alone(x)
    for name, want in alone.state_dict().items():
        assert torch.allclose(padded.state_dict()[name], want, atol=1e-6), name


def test_a_cluster_limit_on_one_node_balances_without_the_root_level():
    """``node: 1`` on one node limits nothing (placement.subtree.level_depths keeps it so a cluster's config
    runs on fewer nodes): training and evaluation route with the GPU-level limit alone."""
    torch.manual_seed(0)
    r = build_router({"type": "branch", "hidden_size": 8, "num_experts": 16, "top_k": 2,
                      "subtree_limit": {"node": 1, "gpu": 2}})
    r.resolve_subtree_levels(("node", "gpu"), (1, 8), tree_prefix=True)
    assert r.subtree_levels == [(0, 1), (3, 2)]
    x = torch.randn(64, 8)
    r.train()(x)
    idx = r.eval()(x).expert_idx
    assert ((idx // 2).unique(dim=1).shape[1] <= 2) and r.balance_bias.any()
