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
    categories: Tensor | None  # [T] (SpecDrop's), or None
    token_ids: Tensor | None  # [T] (hash routing's), or None
    valid: Tensor | None  # [T] bool, False at padding: routed, but out of the router's statistics
    problem: Tensor  # the input-problem code every rank agrees on before a token moves
    tag: int  # the layer's forward count: ranks at different forwards refuse together

    def route(self, router):
        """The strategy's ``Routing`` of these tokens (logical expert ids)."""
        return router(self.h, categories=self.categories, token_ids=self.token_ids, valid=self.valid)

    @property
    def extras(self) -> dict:
        return {"categories": self.categories, "token_ids": self.token_ids}


def tokens_in(h: Tensor, tag: int, router, categories: Tensor | None = None, token_ids: Tensor | None = None,
              valid: Tensor | None = None) -> Tokens:
    """``Tokens`` of ``h`` [T, H] (per-token tensors already flat), with its input-problem code."""
    problem = input_problem(h, categories, router.num_categories)
    return Tokens(h, categories, token_ids, valid, problem, tag)
