"""The tokens stage every MoE forward shares: one forward's flat tokens and what travels with them
(``Tokens``), made once by ``tokens_in``; the exchange stage that takes them is ``exchange.py``."""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from dist_moe.dispatch.agree import input_problem


@dataclass
class Tokens:
    """One forward's flat tokens and what travels with them."""

    h: Tensor  # [T, H]
    categories: Tensor | None = None  # [T] (SpecDrop's), or None
    token_ids: Tensor | None = None  # [T] (hash routing's), or None
    valid: Tensor | None = None  # [T] bool, False at padding: routed, but out of the router's statistics
    problem: Tensor | None = None  # the input-problem code every rank agrees on before a token moves
    tag: int | None = None  # the host's forward count: ranks at different forwards refuse together
    copy_meta: Tensor | None = None  # [T] or [T, C] integers that travel with each copy (categories)
    row_tags: Tensor | None = None  # [T] that reach the experts' capture at the destination (GAR's)
    chosen: tuple[Tensor, Tensor] | None = None  # (expert ids, weights) [T, K] a model's own router chose
    layout: tuple = ((), None)  # (the input's leading shape, its padding mask): per-example summaries (GAR)

    def route(self, router):
        """The strategy's ``Routing`` of these tokens (logical expert ids)."""
        return router(self.h, categories=self.categories, token_ids=self.token_ids, valid=self.valid)

    @property
    def extras(self) -> dict:
        return {"categories": self.categories, "token_ids": self.token_ids}


def tokens_in(h: Tensor, tag: int, num_categories: int | None = None, categories: Tensor | None = None,
              token_ids: Tensor | None = None, valid: Tensor | None = None) -> Tokens:
    """``Tokens`` of ``h`` [T, H] (per-token tensors already flat), with its input-problem code
    (category ids checked against ``num_categories``, the router's)."""
    return Tokens(h, categories, token_ids, valid, input_problem(h, categories, num_categories), tag)
