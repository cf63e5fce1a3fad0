"""Engine-hosted layers against dist-moe's own expert-parallel layer, inside gloo workers.

Same router and expert weights, same tokens on each rank: outputs, aux losses,
input gradients, router gradients and expert gradients must agree.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dist_moe import MoELayer
from placement import Placement
from tests.ep_checks import ROUTERS

H, F, E, T = 8, 12, 8, 13


def reference_layer(router: str, placement: Placement) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(H, F, dict(ROUTERS[router]), placement=placement, group=dist.group.WORLD, dedup="rank")


def rank_inputs(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g)
    cats = torch.randint(0, 5, (T,), generator=g)
    ids = (torch.arange(T) + rank * T) * 7919
    w = torch.randn(T, H, generator=g)
    return x, cats, ids, w


def compare(tag: str, ref: MoELayer, y_ref, aux_ref, x_ref, y, aux, x, router, experts_by_slot) -> None:
    """``experts_by_slot[j]``: name -> engine parameter of this rank's j-th local expert."""
    assert torch.allclose(y, y_ref, atol=1e-5), f"{tag}: outputs differ"
    assert torch.allclose(aux, aux_ref, atol=1e-6), f"{tag}: aux losses differ"
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5), f"{tag}: input gradients differ"
    for (name, p_ref), p in zip(ref.router.named_parameters(), router.parameters()):
        assert torch.allclose(p.grad, p_ref.grad, atol=1e-5), f"{tag}: router gradient {name} differs"
    for name, p_ref in ref.experts.named_parameters():
        for j, params in enumerate(experts_by_slot):
            g = params[name].grad
            g = torch.zeros_like(params[name]) if g is None else g
            assert torch.allclose(g.reshape(p_ref.shape[1:]), p_ref.grad[j], atol=1e-5), \
                f"{tag}: expert {ref.local_expert_ids[j]} gradient {name} differs"
