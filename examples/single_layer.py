"""One MoE layer in one process: a router on its own, then layers that route, run experts and merge.

    .venv/bin/python examples/single_layer.py
"""
import torch

from dist_moe import MoELayer
from dist_moe.routing import build_router

torch.manual_seed(0)
x = torch.randn(32, 64)  # 32 tokens of width 64

# a strategy is pure tensor math: probabilities, chosen experts and their gates, an aux loss
router = build_router({"type": "branch", "hidden_size": 64, "num_experts": 16, "top_k": 4})
routing = router(x)
print("BRANCH: experts of token 0", routing.expert_idx[0].tolist(), "gates", routing.gates[0].tolist())

# a layer = router + experts (+ an always-on shared expert); its input may be [B, S, H]
layer = MoELayer(64, 128, {"type": "switch", "num_experts": 8, "top_k": 2}, shared_expert_hidden=64)
y, aux = layer(x.reshape(4, 8, 64))
(y.square().mean() + aux).backward()
aux = aux.detach()
print("switch layer:", tuple(y.shape), f"aux loss {aux.item():.4f}")

# SpecDrop routes by a category per token (here one per sequence, repeated over its tokens)
specdrop = MoELayer(64, 128, {"type": "specdrop", "num_experts": 8, "num_categories": 8, "p_assigned": 0.7})
y, _ = specdrop(x.reshape(4, 8, 64), categories=torch.tensor([0, 3, 5, 7]))
print("SpecDrop merge coefficients of category 3:", [round(c, 3) for c in specdrop.router.coefficients(3).tolist()])
