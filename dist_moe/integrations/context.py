"""Per-token routing inputs for layers whose forward takes hidden states only.

DeepSpeed's ``MOELayer`` hands its gate only the tokens (and ``used_token``);
Megatron's router gets hidden states and a padding mask. A model that routes by
category (SpecDrop) or hashes token ids sets them around the layer call:

    with routing_context(categories=c):
        y = moe_layer(x)

The values are per token in the layer's flattening order ([B, S] flattens row
by row, Megatron's [S, B] column by column: pass them in the layer's layout).
A context variable, so threads and nested calls each see their own.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from types import MappingProxyType

from torch import Tensor

from dist_moe.dispatch.contract import Tokens, tokens_in

_CONTEXT: contextvars.ContextVar[Mapping] = contextvars.ContextVar("dist_moe_routing_context",
                                                                   default=MappingProxyType({}))


@contextlib.contextmanager
def routing_context(categories: Tensor | None = None, token_ids: Tensor | None = None):
    token = _CONTEXT.set({"categories": categories, "token_ids": token_ids})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def routing_extras(num_tokens: int, layout: tuple | None = None, layout_name: str = "") -> dict:
    """The active context's per-token tensors, flattened and checked against ``num_tokens``; with
    ``layout`` (e.g. Megatron's (S, B)), a tensor of more than one dimension must have that shape:
    a [B, S] tensor for [S, B] tokens has the right size and the wrong order."""
    extras = {}
    for name, value in _CONTEXT.get().items():
        if value is None:
            continue
        if layout is not None and value.dim() > 1 and tuple(value.shape) != tuple(layout):
            raise ValueError(f"routing_context {name} has shape {list(value.shape)}, but the layer's tokens are "
                             f"{layout_name} = {list(layout)}: pass {name} in that layout (a [B, S] tensor needs "
                             f".t() for Megatron's [S, B]), or flattened in its order")
        flat = value.reshape(-1)
        if flat.numel() != num_tokens:
            raise ValueError(f"routing_context {name} has {flat.numel()} entries for {num_tokens} tokens")
        extras[name] = flat
    return extras


def context_tokens(h: Tensor, extras: dict, valid: Tensor | None, tag: int, num_categories: int | None) -> Tokens:
    """The tokens an engine-hosted router routes: ``h`` [T, H] with the categories / token ids its
    ``routing_context`` gave (``extras``), ``valid`` False for padding, tagged with its host's forward."""
    return tokens_in(h, tag, num_categories, extras.get("categories"), extras.get("token_ids"), valid)
