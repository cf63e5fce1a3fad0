"""An image classifier with routed branches: a small conv stem, one MoE block, a linear head.

Fashion-MNIST rows arrive as [B, 784] standardised pixels; the stem sees them as
[B, 1, 28, 28] (two stride-2 convolutions to 32 x 7 x 7), projects to d_model,
and the MoE block routes each image to its branches (SpecDrop: by its
superclass). Everything after the stem, label masking included, is TabularMoE's.
"""
from __future__ import annotations

from torch import nn

from dist_moe.models.tabular import TabularMoE


class ImageMoE(TabularMoE):
    def __init__(self, num_features: int, num_classes: int, moe, d_model: int = 64, **kwargs):
        if num_features != 28 * 28:
            raise ValueError(f"ImageMoE takes 28 x 28 images (784 features), got {num_features}")
        if not d_model:
            raise ValueError("ImageMoE needs model.d_model > 0 (the stem's output width)")
        super().__init__(num_features, num_classes, moe, d_model=d_model, **kwargs)
        self.input = nn.Sequential(
            nn.Unflatten(1, (1, 28, 28)),
            nn.Conv2d(1, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(32 * 7 * 7, d_model),
        )
