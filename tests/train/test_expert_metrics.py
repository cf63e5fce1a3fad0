"""GAR appendix E metrics: LVar, utilization, gradient-mass purity, NMI, ARI, structure purity, entropy."""
import itertools
import math

import pytest
import torch

from dist_moe.train.metrics.experts import (
    ari,
    contingency,
    gradient_mass_purity,
    lvar,
    nmi,
    routing_entropy,
    structure_purity,
    utilization,
)


def test_lvar_and_utilization():
    assert lvar(torch.ones(8)) == 0.0 and utilization(torch.ones(8)) == 1.0
    one_hot = torch.zeros(8)
    one_hot[2] = 5.0
    assert math.isclose(lvar(one_hot), 7 / 64)  # the paper's bound (E-1)/E^2 for E = 8
    assert utilization(one_hot) == 1 / 8
    load = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.05, 0.05])  # 1/(2E) = 1/12: the last two are under-used
    assert math.isclose(utilization(load), 4 / 6)
    assert math.isclose(lvar(load), float(((load.double() - 1 / 6) ** 2).mean()), rel_tol=1e-6)
    with pytest.raises(ValueError, match="no mass"):
        lvar(torch.zeros(4))


def test_gradient_mass_purity():
    g = torch.zeros(2, 3, 4)  # 2 tasks, 3 experts
    g[0, 0] = torch.tensor([3.0, 4.0, 0, 0])  # norm 5
    g[1, 0] = torch.tensor([0, 0, 0, 5.0])  # norm 5: expert 0 is split evenly
    g[0, 1] = torch.ones(4)  # expert 1 only sees task 0
    # expert 2 has no gradient mass: counts as 0 and stays in the average
    assert math.isclose(gradient_mass_purity(g), (0.5 + 1.0 + 0.0) / 3)
    assert math.isclose(gradient_mass_purity(g.norm(dim=-1)), (0.5 + 1.0 + 0.0) / 3)


def test_contingency_nmi_ari_purity():
    tasks = torch.tensor([0, 0, 1, 1, 2, 2])
    idx = torch.tensor([[0, 1], [0, 1], [2, 3], [2, -1], [4, 5], [5, 4]])
    c = contingency(tasks, idx, 3, 6)
    assert c.sum() == 11 and c[1, 3] == 1 and c[1].sum() == 3
    assert structure_purity(c) == 1.0
    perfect = torch.diag(torch.tensor([4.0, 4.0, 4.0]))
    assert math.isclose(nmi(perfect), 1.0) and math.isclose(ari(perfect), 1.0)
    assert abs(nmi(torch.full((3, 4), 5.0))) < 1e-12  # no association at all
    g = torch.Generator().manual_seed(1)  # independent labels: ARI is 0 in expectation
    c = contingency(torch.randint(0, 3, (20000,), generator=g), torch.randint(0, 4, (20000, 1), generator=g), 3, 4)
    assert abs(ari(c)) < 0.005 and nmi(c) < 0.005


def test_ari_matches_pair_counting():
    g = torch.Generator().manual_seed(0)
    tasks = torch.randint(0, 3, (40,), generator=g)
    experts = torch.where(torch.rand(40, generator=g) < 0.6, tasks, torch.randint(0, 4, (40,), generator=g))
    c = contingency(tasks, experts.unsqueeze(1), 3, 4)
    # Rand-index pair counts by brute force over all pairs of selection events
    same_t = same_e = both = 0
    for i, j in itertools.combinations(range(40), 2):
        st, se = bool(tasks[i] == tasks[j]), bool(experts[i] == experts[j])
        same_t, same_e, both = same_t + st, same_e + se, both + (st and se)
    n_pairs = 40 * 39 / 2
    expected = same_t * same_e / n_pairs
    brute = (both - expected) / ((same_t + same_e) / 2 - expected)
    assert math.isclose(ari(c), brute, rel_tol=1e-12)


def test_routing_entropy():
    assert math.isclose(routing_entropy(torch.full((3, 8), 1 / 8)), math.log(8))
    assert routing_entropy(torch.eye(4)) == 0.0
