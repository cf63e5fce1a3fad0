"""MoELayer on one process: equals a token-by-token reference, forward and backward."""
import pytest
import torch

from dist_moe import MoELayer
from dist_moe.routing.capacity import capacity_for

H, F, E = 8, 12, 8

ROUTERS = {
    "switch": {"type": "switch", "num_experts": E, "top_k": 2, "jitter_eps": 0.0},
    "branch": {"type": "branch", "num_experts": E, "top_k": 4},
    "deepseek_v3": {"type": "deepseek_v3", "num_experts": E, "top_k": 3},
    "skywork": {"type": "skywork", "num_experts": E, "top_k": 1, "jitter_eps": 0.0},
    "hash": {"type": "hash", "num_experts": E, "top_k": 2},
    "uniform": {"type": "uniform", "num_experts": E},
    "specdrop": {"type": "specdrop", "num_experts": E, "num_categories": 3, "p_assigned": 0.6, "p_leak": 0.1},
}


def reference(layer: MoELayer, x: torch.Tensor, routing) -> torch.Tensor:
    """sum_k gate_tk * expert_{e_tk}(x_t), one token and one expert at a time."""
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros(H, dtype=x.dtype)
        for e, g in zip(routing.expert_idx[t].tolist(), routing.gates[t]):
            if e >= 0:
                y = y + g * layer.experts.expert(e, x[t : t + 1])[0]
        if layer.shared_expert is not None:
            y = y + layer.shared_expert(x[t : t + 1])[0]
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("name", sorted(ROUTERS))
@pytest.mark.parametrize("expert_type, shared, capacity", [("swiglu", 0, None), ("gelu", 16, 1.0)])
def test_layer_matches_reference(name, expert_type, shared, capacity):
    layer = MoELayer(H, F, ROUTERS[name], expert_type=expert_type, shared_expert_hidden=shared,
                     capacity_factor=capacity).eval()
    x = torch.randn(37, H, requires_grad=True)
    cats = torch.randint(0, 3, (37,))
    y, aux = layer(x, categories=cats)
    routing = layer.last_routing
    # the same routing with its autograd graph (eval mode is deterministic), capacity drops applied
    live = layer.router(x, categories=cats)
    assert torch.equal(torch.where(routing.expert_idx >= 0, live.expert_idx, -1), routing.expert_idx)
    live.gates = torch.where(routing.expert_idx >= 0, live.gates, 0.0)
    live.expert_idx = routing.expert_idx
    ref = reference(layer, x, live)
    assert torch.allclose(y, ref, atol=1e-5)
    w = torch.randn_like(y)
    g = torch.autograd.grad((y * w).sum(), [x] + list(layer.experts.parameters()))
    g_ref = torch.autograd.grad((ref * w).sum(), [x] + list(layer.experts.parameters()))
    for a, b in zip(g, g_ref):
        assert torch.allclose(a, b, atol=1e-5)
    if capacity is not None:
        cap = capacity_for(37, routing.expert_idx.shape[1], E, capacity)
        kept = routing.expert_idx[routing.expert_idx >= 0]
        assert torch.bincount(kept, minlength=E).max() <= cap
        assert routing.stats["dropped"] == int((routing.expert_idx < 0).sum())


def test_sequence_input_with_per_sequence_categories_and_bf16():
    layer = MoELayer(H, F, ROUTERS["specdrop"], shared_expert_hidden=8)
    x = torch.randn(3, 5, H)
    cats = torch.tensor([0, 2, 1])
    y, aux = layer(x, categories=cats)
    assert y.shape == x.shape and aux.dim() == 0
    # each token carries its sequence's category
    first = layer.last_routing.expert_idx[:, 0].reshape(3, 5)
    assert torch.equal(first, cats.unsqueeze(1).expand(3, 5))
    yb, _ = layer.bfloat16()(x.bfloat16(), categories=cats)
    assert yb.dtype == torch.bfloat16 and torch.isfinite(yb.float()).all()
    with pytest.raises(ValueError, match="categories"):
        layer(x, categories=torch.tensor([0, 1]))


def test_layer_trains_and_router_receives_gradient():
    torch.manual_seed(0)
    layer = MoELayer(H, F, ROUTERS["branch"])
    x = torch.randn(64, H)
    target = torch.randn(64, H)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        y, aux = layer(x)
        loss = ((y - target) ** 2).mean() + aux
        opt.zero_grad()
        loss.backward()
        assert layer.router.node_map.weight.grad.abs().sum() > 0
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0]


def test_layer_validation():
    with pytest.raises(ValueError, match="dedup"):
        MoELayer(H, F, ROUTERS["switch"], dedup="token")
    with pytest.raises(ValueError, match="capacity_factor"):
        MoELayer(H, F, ROUTERS["switch"], capacity_factor=-1.0)
    with pytest.raises(ValueError, match="hidden_size"):
        MoELayer(H, F, {**ROUTERS["switch"], "hidden_size": H + 1})
    with pytest.raises(ValueError, match="expert kind"):
        MoELayer(H, F, ROUTERS["switch"], expert_type="relu")
    layer = MoELayer(H, F, ROUTERS["switch"])
    with pytest.raises(ValueError, match="hidden_size"):
        layer(torch.randn(4, H + 2))


def test_last_routing_holds_no_graph():
    layer = MoELayer(H, F, ROUTERS["switch"])
    layer(torch.randn(10, H))
    r = layer.last_routing
    assert not r.probs.requires_grad and not r.gates.requires_grad
