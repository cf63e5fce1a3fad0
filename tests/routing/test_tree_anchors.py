"""BRANCH's training-time anchors (eq. 5-9): one sum over the ranks per depth in the forward, one
for every depth's gradient in the backward, with the values and gradients of the per-depth
computation the paper writes (a sum per depth, each differentiable on its own)."""
import torch

from dist_moe.distributed.reductions import all_reduce_sum
from dist_moe.routing.tree_anchors import batch_anchors
from placement.subtree import tree_probs
from tests.support.dist_utils import run_workers

TINY = torch.finfo(torch.float32).tiny


def _per_depth(f, depth, keep, group):
    """The equations as written: each depth's statistic from its own differentiable sum."""
    masks, stats, masses = f.new_ones(f.shape[0], 1), [], []
    for d in range(depth):
        fd = f[:, (1 << d) - 1:(1 << (d + 1)) - 1]
        w = masks.detach() if keep is None else masks.detach() * keep.unsqueeze(1)
        mass, weighted = all_reduce_sum(torch.cat([w.sum(0), (w * fd).sum(0)]), group).split(1 << d)
        stat = weighted / mass.clamp_min(TINY)
        p = torch.sigmoid(fd - stat)
        masks = torch.stack((masks * (1 - p), masks * p), dim=2).reshape(f.shape[0], 2 << d)
        stats.append(stat)
        masses.append(mass)
    return torch.cat(stats), torch.cat(masses), masks


def _both(f0, depth, keep, group, weights):
    out = []
    for fn in (_per_depth, None):
        f = f0.clone().requires_grad_()
        if fn is None:
            a, mass = batch_anchors(f, depth, keep, group)
            probs = tree_probs(f, a)
        else:
            a, mass, probs = fn(f, depth, keep, group)
        ((probs * weights).sum() + (a * weights[0, : a.shape[0]]).sum()).backward()
        out.append((a.detach(), mass, probs.detach(), f.grad))
    return out


def test_values_and_gradients_equal_the_per_depth_sums_in_one_process():
    g = torch.Generator().manual_seed(0)
    for depth, keep in ((4, None), (3, torch.rand(50, generator=g) > 0.3)):
        f0 = torch.randn(50, (1 << depth) - 1, generator=g)
        weights = torch.randn(50, 1 << depth, generator=g)
        (a1, m1, p1, g1), (a2, m2, p2, g2) = _both(f0, depth, keep, None, weights)
        assert torch.equal(a1, a2) and torch.equal(m1, m2) and torch.equal(p1, p2)  # the same sums, in order
        torch.testing.assert_close(g2, g1, rtol=1e-6, atol=1e-7)


def _ranks_worker(rank, world):
    import torch.distributed as dist

    from benchmarks.collectives import count_collectives

    g = torch.Generator().manual_seed(10 + rank)  # every rank its own tokens
    depth = 4
    f0 = torch.randn(30 + 9 * rank, (1 << depth) - 1, generator=g)
    weights = torch.randn(f0.shape[0], 1 << depth, generator=g)
    keep = torch.rand(f0.shape[0], generator=g) > 0.2
    (a1, m1, p1, g1), (a2, m2, p2, g2) = _both(f0, depth, keep, dist.group.WORLD, weights)
    assert torch.equal(a1, a2) and torch.equal(m1, m2) and torch.equal(p1, p2), rank
    torch.testing.assert_close(g2, g1, rtol=1e-6, atol=1e-7)
    f = f0.clone().requires_grad_()
    fwd = count_collectives(lambda: batch_anchors(f, depth, keep, dist.group.WORLD))
    a, _ = batch_anchors(f, depth, keep, dist.group.WORLD)
    bwd = count_collectives(lambda: a.sum().backward())
    assert fwd["all_reduce"] == depth and bwd["all_reduce"] == 1, (rank, fwd, bwd)


def test_on_two_ranks_one_sum_per_depth_forward_and_one_backward():
    run_workers(_ranks_worker, 2, timeout=120)
