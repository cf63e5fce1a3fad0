"""The BRANCH paper's tabular model: input stage -> one MoE block -> linear head.

On the UCI datasets the input stage is feature standardisation alone (done by
the data loader), so the MoE hidden size is the feature count unless
``d_model`` asks for a projection. The MoE block has no residual connection.

With categories (a coarse label per row, e.g. ``satimage_landcover``) the MoE
layer routes by them (SpecDrop), and ``label_mask`` gives SpecDrop paper's
dense control: logits of classes outside the row's category are masked out.
"""
from __future__ import annotations

from torch import Tensor, nn

from dist_moe.moe.layer import MoELayerConfig
from dist_moe.routing.hashing import hash_rows


class TabularMoE(nn.Module):
    def __init__(self, num_features: int, num_classes: int, moe: nn.Module | MoELayerConfig | dict,
                 d_model: int = 0, post_norm: bool = False, class_category: Tensor | None = None,
                 label_mask: bool = False):
        """``moe``: the MoE layer (an engine-hosted one with MoELayer's interface, ``dist_moe.train.step.engines``),
        its ``MoELayerConfig`` (built here, locally), or a router config (a local MoELayer with 32-wide
        SwiGLU experts, dropless)."""
        super().__init__()
        if label_mask and class_category is None:
            raise ValueError("model.label_mask needs categories: set data.categories")
        self.label_mask = label_mask
        self.register_buffer("class_category", class_category, persistent=False)
        hidden = d_model or num_features
        self.input = nn.Linear(num_features, d_model) if d_model else nn.Identity()
        if not isinstance(moe, nn.Module):
            config = moe if isinstance(moe, MoELayerConfig) else MoELayerConfig(hidden, 32, moe)
            if config.hidden_size != hidden:
                raise ValueError(f"the MoE layer's hidden_size {config.hidden_size} != the model's {hidden}")
            moe = config.build()
        self.moe = moe
        self.norm = nn.LayerNorm(hidden) if post_norm else nn.Identity()
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor, categories: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # Hash routing keys on the example's raw feature vector (BRANCH paper B.2).
        ids = hash_rows(x) if "token_ids" in self.moe.router.inputs else None
        h, aux = self.moe(self.input(x), categories=categories, token_ids=ids)
        logits = self.head(self.norm(h))
        if self.label_mask:
            if categories is None:
                raise ValueError("a label-masked model needs the categories of its rows")
            outside = self.class_category.unsqueeze(0) != categories.unsqueeze(1)
            logits = logits.masked_fill(outside, float("-inf"))
        return logits, aux
