"""Normalised tree distance (BRANCH paper appendix B.4)."""
import math

import pytest
import torch

from placement import random_pair_tree_distance, tree_distance


def test_known_pairs():
    # (7, 8): adjacent indices but maximal tree separation; (0, 1): siblings
    assert tree_distance(torch.tensor([[7, 8]]), 16) == 1.0
    assert tree_distance(torch.tensor([[0, 1]]), 16) == 0.25
    assert tree_distance(torch.tensor([[4, 6]]), 16) == 0.5
    # mean over tokens and all i<j pairs: {0,1,2}: L = 1, 2, 2
    assert math.isclose(tree_distance(torch.tensor([[0, 1, 2]]), 16), (1 + 2 + 2) / 3 / 4)
    # dropped slots (-1) are left out; a token with < 2 experts has no pair
    assert tree_distance(torch.tensor([[0, 1, -1], [3, -1, -1]]), 16) == 0.25
    assert math.isnan(tree_distance(torch.tensor([[3], [4]]), 16))


def test_random_pairs_match_closed_form():
    assert math.isclose(random_pair_tree_distance(16), 0.81667, abs_tol=1e-5)  # the paper's 0.817
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(20000)])
    assert abs(tree_distance(idx, 16) - random_pair_tree_distance(16)) < 0.005


def test_bad_input():
    with pytest.raises(ValueError, match="num_experts"):
        tree_distance(torch.tensor([[0, 1]]), 1)
    with pytest.raises(ValueError, match="power of two"):
        random_pair_tree_distance(12)


def test_busiest_unit_over_the_mean_unit():
    from placement import busiest

    load = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    assert busiest(load, torch.tensor([0, 0, 1, 1, 2, 2])) == pytest.approx(4 / 2)  # [4, 2, 0]: max 4, mean 2
    assert busiest(load, torch.tensor([0, 1, 0, 1, 0, 1])) == pytest.approx(4 / 3)
    assert math.isnan(busiest(torch.zeros(4), torch.tensor([0, 0, 1, 1])))  # nothing routed
