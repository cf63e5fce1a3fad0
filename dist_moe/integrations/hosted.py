"""What an engine-hosted MoE layer shares with dist-moe's MoELayer: its call signature.

``(y, aux) = layer(x [..., H], categories, token_ids, padding_mask)``: per-token or
per-sequence categories and token ids are flattened as MoELayer does and handed to
the engine's router through ``routing_context``; padding is routed like any token.
Subclasses say how their engine runs the flat tokens (``_run``) and where their
router and last routing live.
"""
from __future__ import annotations

from torch import Tensor, nn

from dist_moe.integrations.context import routing_context


class HostedMoE(nn.Module):
    hidden_size: int

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    def _run(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """tokens [T, H] -> (y [T, H], aux loss) through the engine's layer."""
        raise NotImplementedError

    def forward(self, x: Tensor, categories: Tensor | None = None, token_ids: Tensor | None = None,
                padding_mask: Tensor | None = None):
        from dist_moe.layer import per_token

        categories, token_ids = per_token(categories, x.shape, "categories"), per_token(token_ids, x.shape, "token_ids")
        with routing_context(categories=categories, token_ids=token_ids):
            y, aux = self._run(x.reshape(-1, self.hidden_size))
        return y.reshape(x.shape), aux
