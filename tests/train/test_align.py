"""SpecDrop Align: zero-ablation per expert, per category; equal on one process and on 2 ranks."""
import torch

from dist_moe import MoELayer
from dist_moe.train.align import ablate, specdrop_align
from tests.support.dist_utils import run_workers

H, E, C = 6, 4, 8


def make_data(layer, seed=0, n=64):
    """Inputs, categories, and the layer's own outputs as targets: a 'trained' model, so removing
    an expert it uses can only raise the loss."""
    g = torch.Generator().manual_seed(seed)
    x, cats = torch.randn(n, H, generator=g), torch.randint(0, C, (n,), generator=g)
    with torch.no_grad():
        target, _ = layer(x, categories=cats)
    return x, cats, target


def evaluator(x, cats, target):
    def evaluate(layer):
        y, _ = layer(x, categories=cats)
        per_token = ((y - target) ** 2).mean(1)
        return (torch.zeros(C, dtype=torch.float64).index_add(0, cats, per_token.double()),
                torch.bincount(cats, minlength=C).double())
    return evaluate


def specdrop(variant, **kw):
    torch.manual_seed(0)
    cfg = {"type": "specdrop", "num_experts": E, "num_categories": C, "variant": variant}
    if variant != "uniform":
        cfg["p_assigned"] = 0.9
    return MoELayer(H, 8, cfg, **kw).eval()


def test_hard_routing_aligns_every_category():
    layer = specdrop("hard")
    out = specdrop_align(layer, evaluator(*make_data(layer)), layer.router.assigned_expert, E)
    assert out["align"] == 1.0
    assert torch.equal(out["most_hurt"], torch.arange(C) % E)
    # ablating an expert changes only its own categories under hard routing
    for e in range(E):
        others = torch.arange(C) % E != e
        assert torch.allclose(out["delta"][e, others], torch.zeros(int(others.sum()), dtype=torch.float64))


def test_ties_go_to_the_lowest_index_and_ablation_is_restored():
    layer = specdrop("uniform")
    with torch.no_grad():
        for p in layer.experts.parameters():
            p.copy_(p[0].expand_as(p))  # identical experts: every ablation hurts equally
    out = specdrop_align(layer, evaluator(*make_data(layer)), layer.router.assigned_expert, E)
    assert torch.equal(out["most_hurt"], torch.zeros(C, dtype=torch.long))
    assert out["align"] == 2 / C  # categories 0 and 4 are assigned to expert 0
    x, cats, _ = make_data(layer)
    before, _ = layer(x, categories=cats)
    with ablate(layer, [1, 2]):
        assert layer.ablated_experts == {1, 2}
    after, _ = layer(x, categories=cats)
    assert torch.equal(before, after) and not layer.ablated_experts


def _align_worker(rank, world):
    import torch.distributed as dist

    from placement import Placement, Topology

    full = specdrop("soft")
    x, cats, target = make_data(full, n=80)
    ref = specdrop_align(full, evaluator(x, cats, target), full.router.assigned_expert, E)
    ep = specdrop("soft", group=dist.group.WORLD, placement=Placement.round_robin(E, world),
                  topology=Topology(("node", "gpu"), (2, 1)), dedup="rank")
    for name, p in ep.experts.named_parameters():
        p.data.copy_(getattr(full.experts, name).data[ep.local_expert_ids])
    mine = torch.arange(80) % world == rank
    out = specdrop_align(ep, evaluator(x[mine], cats[mine], target[mine]), ep.router.assigned_expert, E,
                         group=dist.group.WORLD)
    assert torch.allclose(out["delta"], ref["delta"], atol=1e-6)
    assert out["align"] == ref["align"] and torch.equal(out["most_hurt"], ref["most_hurt"])


def test_align_on_two_ranks_equals_one_process():
    run_workers(_align_worker, 2, timeout=60)
