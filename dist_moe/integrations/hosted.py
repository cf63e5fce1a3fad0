"""What an engine-hosted MoE layer shares with dist-moe's MoELayer: its call signature.

``(y, aux) = layer(x [..., H], categories, token_ids, padding_mask)``: per-token or per-sequence
categories and token ids are flattened as MoELayer does and handed to the engine's router through
``routing_context``; padding (True in ``padding_mask``) is left out of the router's statistics, in each
engine's own way (DeepSpeed's ``used_token``, Megatron's ``padding_mask``).
"""
from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from dist_moe.dispatch.contract import per_token
from dist_moe.distributed.collective_order import through_exchanges
from dist_moe.integrations.context import routing_context


def call_engine(run: Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor]], x: Tensor,
                categories: Tensor | None, token_ids: Tensor | None,
                padding_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """``run(tokens [T, H], padding [T] bool or None) -> (y [T, H], aux)``, the engine's layer, on ``x``
    flattened, with its categories and token ids in ``routing_context``; y in ``x``'s shape."""
    categories, token_ids = per_token(categories, x.shape, "categories"), per_token(token_ids, x.shape, "token_ids")
    padding = per_token(padding_mask, x.shape, "padding_mask")
    with routing_context(categories=categories, token_ids=token_ids):
        # the engine's own dispatcher exchanges in backward too: no gradient sum starts before them
        y, aux = run(through_exchanges(x.reshape(-1, x.shape[-1])), padding)
    return y.reshape(x.shape), aux
