"""SpecDrop: round-robin assignment, fixed denominator, schedule, imbalance rule, variants."""
import math

import pytest
import torch

from dist_moe.routing import SpecDropRouter, build_router


def test_paper_worked_example():
    """K=20, p_a=0.7, p_i=0.3: S=6.4, coefficients 0.109 (assigned) and 0.047 (others)."""
    r = SpecDropRouter(num_experts=20, num_categories=20, p_assigned=0.7)
    assert math.isclose(r.S, 6.4)
    coeffs = r.coefficients(5)
    assert math.isclose(float(coeffs[5]), 0.7 / 6.4, rel_tol=1e-6) and round(float(coeffs[5]), 3) == 0.109
    others = torch.cat([coeffs[:5], coeffs[6:]])
    assert torch.allclose(others, torch.full((19,), 0.3 / 6.4)) and round(float(others[0]), 3) == 0.047
    assert math.isclose(float(coeffs.sum()), 1.0, rel_tol=1e-6)


def test_round_robin_assignment_and_forward():
    r = SpecDropRouter(num_experts=4, num_categories=10, p_assigned=0.6, p_leak=0.2)
    assert r.assigned_expert.tolist() == [c % 4 for c in range(10)]
    cats = torch.tensor([0, 5, 9, 3])
    out = r(torch.randn(4, 3), categories=cats)
    assert out.expert_idx.shape == (4, 4)  # dense by default
    assert out.expert_idx[:, 0].tolist() == [0, 1, 1, 3]  # assigned expert first
    S = 0.6 + 3 * 0.2
    for t, c in enumerate(cats.tolist()):
        expected = torch.full((4,), 0.2 / S)
        expected[c % 4] = 0.6 / S
        assert torch.allclose(out.probs[t], expected)
        assert torch.allclose(out.gates[t], expected[out.expert_idx[t]])


def test_schedule_endpoints_and_constant_sum():
    r = SpecDropRouter(num_experts=8, num_categories=8, p_assigned=0.8, warmup_fraction=0.5)
    S = 0.8 + 7 * 0.2
    seen = []
    for f in [0.0, 0.1, 0.25, 0.4, 0.5, 0.75, 1.0]:
        r.set_progress(f)
        p_a, p_i = r.scheduled_weights()
        assert math.isclose(p_a + 7 * p_i, S, rel_tol=1e-9)  # constant sum
        table = r.weight_table()
        assert torch.allclose(table.sum(1), torch.full((8,), S))
        seen.append(p_a)
    assert math.isclose(seen[0], S / 8)  # uniform merge at warmup start
    assert math.isclose(seen[4], 0.8) and math.isclose(seen[-1], 0.8)  # target reached at w_r and kept
    ramp = 0.5 * (1 - math.cos(math.pi * 0.2))  # progress 0.1 of a 0.5 warmup
    assert math.isclose(seen[1], S / 8 + (0.8 - S / 8) * ramp)
    assert all(a <= b + 1e-12 for a, b in zip(seen, seen[1:]))
    with pytest.raises(ValueError, match="progress"):
        r.set_progress(1.5)


def test_total_steps_drives_progress_and_state_dict_keeps_it():
    r = SpecDropRouter(num_experts=4, num_categories=4, p_assigned=0.7, warmup_fraction=1.0, total_steps=10)
    x, c = torch.randn(6, 3), torch.randint(0, 4, (6,))
    first = r.train()(x, categories=c)
    S = 0.7 + 3 * 0.3
    assert torch.allclose(first.probs, torch.full((6, 4), 0.25))  # step 1 runs at progress 0: uniform merge
    for _ in range(4):
        r.train()(x, categories=c)
    assert math.isclose(float(r.progress), 0.4)  # 4 steps completed before the 5th forward
    r.eval()(x, categories=c)
    assert math.isclose(float(r.progress), 0.4)  # inference does not advance the schedule
    assert r.scheduled_weights()[0] + 3 * r.scheduled_weights()[1] == pytest.approx(S)
    with pytest.raises(ValueError, match="total_steps"):
        r.set_progress(0.5)
    clone = SpecDropRouter(num_experts=4, num_categories=4, p_assigned=0.7, warmup_fraction=1.0, total_steps=10)
    clone.load_state_dict(r.state_dict())
    assert clone.scheduled_weights() == r.scheduled_weights()
    assert int(clone.step) == 5


def test_imbalance_rule_totals_and_direction():
    K, M, beta = 4, 4, 2.0
    freqs = [0.55, 0.25, 0.15, 0.05]
    r = SpecDropRouter(num_experts=K, num_categories=M, p_assigned=0.6, imbalance_beta=beta, category_freqs=freqs)
    S = 0.6 + 3 * 0.4
    table = r.weight_table().double()
    assert torch.allclose(table.sum(1), torch.full((M,), S, dtype=torch.float64), atol=1e-6)  # S^c = S
    for c, pi in enumerate(freqs):
        gap = 0.2 * ((1 - pi) / (1 - 1 / M)) ** beta
        assert math.isclose(float(table[c, c]), S / K + gap * (K - 1) / K, rel_tol=1e-6)
        assert math.isclose(float(table[c, (c + 1) % K]), S / K - gap / K, rel_tol=1e-5)
    assert float(table[3, 3] - table[3, 0]) > float(table[0, 0] - table[0, 1])  # rare category: larger gap
    # beta = 0 recovers the scalar configuration
    flat = SpecDropRouter(num_experts=K, num_categories=M, p_assigned=0.6, category_freqs=freqs)
    scalar = SpecDropRouter(num_experts=K, num_categories=M, p_assigned=0.6)
    assert torch.allclose(flat.weight_table(), scalar.weight_table())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"p_assigned": 0.6, "imbalance_beta": 8.0, "category_freqs": [0.7, 0.1, 0.1, 0.1]}, "clipping"),
        ({"p_assigned": 0.95, "p_leak": 0.05, "imbalance_beta": 3.0, "category_freqs": [0.85, 0.05, 0.05, 0.05]},
         "clipping"),
        ({"p_assigned": 0.6, "imbalance_beta": 1.0}, "category_freqs"),
        ({"p_assigned": 0.6, "imbalance_beta": 1.0, "category_freqs": [0.5, 0.5]}, "category_freqs"),
        ({"p_assigned": 0.6, "imbalance_beta": 1.0, "category_freqs": [0.5, 0.5, 0.5, -0.5]}, "category_freqs"),
        ({"p_assigned": 0.4}, "p_leak"),  # complementary leak 0.6 >= p_a
        ({"p_assigned": 1.2}, "p_assigned"),
        ({"p_assigned": 0.7, "p_leak": 0.0}, "p_leak"),
        ({"p_assigned": 0.7, "variant": "hard", "p_leak": 0.1}, "p_leak"),
        ({"p_assigned": 0.7, "variant": "hard", "imbalance_beta": 1.0, "category_freqs": [0.25] * 4}, "hard"),
        ({"p_assigned": 0.7, "warmup_fraction": 2.0}, "warmup_fraction"),
        ({"p_assigned": 0.7, "total_steps": 0}, "total_steps"),
    ],
)
def test_invalid_configs_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpecDropRouter(num_experts=4, num_categories=4, **kwargs)


def test_clipping_check_covers_whole_schedule():
    # valid at the end point means valid at every progress (the gap grows monotonically)
    freqs = [0.4, 0.3, 0.2, 0.1]
    r = SpecDropRouter(num_experts=4, num_categories=4, p_assigned=0.7, warmup_fraction=1.0,
                       imbalance_beta=2.0, category_freqs=freqs)
    for f in torch.linspace(0, 1, 21).tolist():
        r.set_progress(f)
        t = r.weight_table()
        assert (t >= 0).all() and (t <= 1).all()


def test_categories_required_and_checked():
    r = SpecDropRouter(num_experts=4, num_categories=3, p_assigned=0.7)
    x = torch.randn(5, 2)
    with pytest.raises(ValueError, match="requires categories"):
        r(x)
    with pytest.raises(ValueError, match="out of range"):
        r(x, categories=torch.tensor([0, 1, 2, 3, 0]))
    with pytest.raises(ValueError, match="shape"):
        r(x, categories=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="integer"):
        r(x, categories=torch.zeros(5))


def test_bernoulli_masks_fixed_denominator_and_determinism():
    r = SpecDropRouter(num_experts=4, num_categories=4, p_assigned=0.9, p_leak=0.3, variant="bernoulli", seed=1)
    S = 0.9 + 3 * 0.3
    n = 20000
    x = torch.randn(n, 2)
    c = torch.arange(n) % 4
    ids = torch.arange(n) * 7 + 3
    with r.frozen_state():
        a = r.train()(x, categories=c, token_ids=ids)
        b = r.train()(x, categories=c, token_ids=ids)
    assert torch.equal(a.gates, b.gates)  # same (seed, step, token): same mask on every rank
    vals = set(torch.unique(a.gates * S).round(decimals=5).tolist())
    assert vals <= {0.0, 1.0}  # m_k / S with the fixed denominator, not the active count
    dense = a.dense_gates() * S
    assigned = dense[torch.arange(n), c % 4]
    assert abs(float(assigned.mean()) - 0.9) < 0.01
    leak = dense.sum(1) - assigned
    assert abs(float(leak.mean()) / 3 - 0.3) < 0.01
    # masks are independent of the order tokens arrive in
    perm = torch.randperm(n)
    with r.frozen_state():
        p = r(x[perm], categories=c[perm], token_ids=ids[perm])
    assert torch.equal(p.dense_gates(), a.dense_gates()[perm])
    # the next step draws new masks; inference is the deterministic soft merge
    r.train()(x, categories=c, token_ids=ids)
    with r.frozen_state():
        d = r(x, categories=c, token_ids=ids)
    assert not torch.equal(d.gates, a.gates)
    r.eval()
    e = r(x, categories=c)
    assert torch.allclose(e.gates, e.probs.gather(1, e.expert_idx))


def test_keep_probability_one_never_drops():
    from dist_moe.routing.hashing import uniform01

    u = uniform01(torch.tensor([0, 2**31, 2**32 - 1, 2**32 - 129]))
    assert (u < 1.0).all() and (u >= 0).all()


def test_hard_variant_warmup_ends_hard_and_bernoulli_is_dense():
    hard = SpecDropRouter(num_experts=4, num_categories=4, p_assigned=0.8, variant="hard", warmup_fraction=0.5)
    hard.set_progress(0.0)
    assert torch.allclose(hard.coefficients(1), torch.full((4,), 0.25))
    hard.set_progress(0.5)
    assert torch.allclose(hard.coefficients(1), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="top_k"):
        SpecDropRouter(num_experts=4, num_categories=4, p_assigned=0.8, variant="bernoulli", top_k=2)


def test_hard_and_uniform_variants():
    hard = SpecDropRouter(num_experts=4, num_categories=4, p_assigned=0.8, variant="hard")
    out = hard(torch.randn(4, 2), categories=torch.arange(4))
    assert torch.allclose(out.probs, torch.eye(4))
    uni = build_router({"type": "specdrop", "num_experts": 5, "num_categories": 3, "variant": "uniform"})
    out = uni(torch.randn(6, 2))  # the No-Routing control needs no labels
    assert torch.allclose(out.probs, torch.full((6, 5), 0.2))
    assert torch.allclose(uni.coefficients(2), torch.full((5,), 0.2))


def test_top_k_subset_keeps_fixed_coefficients():
    r = SpecDropRouter(num_experts=6, num_categories=6, p_assigned=0.5, p_leak=0.1, top_k=2)
    out = r(torch.randn(3, 2), categories=torch.tensor([4, 0, 5]))
    assert out.expert_idx[:, 0].tolist() == [4, 0, 5]
    assert torch.allclose(out.gates[:, 0], torch.full((3,), 0.5 / 1.0))
    # ties among leak weights resolve to the lowest index
    assert out.expert_idx[:, 1].tolist() == [0, 1, 0]
