"""A one-MoE-layer regressor: linear input stage + ReLU, an MoE layer, a scalar head.

Small enough for GAR tests and benchmarks, where every group of examples gets its
own forward and backward.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from dist_moe.moe.layer import MoELayer


class MoERegressor(nn.Module):
    def __init__(self, in_features: int, hidden_size: int, ffn_hidden_size: int, router: dict, **layer_kwargs):
        super().__init__()
        self.inp = nn.Linear(in_features, hidden_size)
        self.moe = MoELayer(hidden_size, ffn_hidden_size, dict(router), **layer_kwargs)
        self.head = nn.Linear(hidden_size, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h, aux = self.moe(torch.relu(self.inp(x)))
        return self.head(h).squeeze(-1), aux
