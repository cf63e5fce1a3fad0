"""The forward every MoE layer here shares, written once: tokens -> route -> (agree) -> dispatch ->
experts -> combine. ``MoELayer`` and both engines' layers supply their own routing stage (a
strategy call plus what their engine asks of it: capacity, padding's gates) and record what
they keep afterwards; everything between is here.

Agreement (``agree.py``): with an exchanging dispatcher, the ranks agree on bad input and on
being at the same forward in the header of the first exchange; ranks beyond the exchange that
route their own tokens (data parallelism in an engine) agree with one small all-reduce over
``agree_group``. Inside the agreement the router leaves its input checks to it, and a refusal
restores the router's buffers. Alone (a local dispatcher, no wider group) the router checks its
own input.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from dist_moe.dispatch.agree import agree, agreed_routing, input_problem
from dist_moe.dispatch.contract import Dispatcher, ExpertsContract
from dist_moe.dispatch.stages import stage


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


def route_and_dispatch(tokens: Tokens, router, route: Callable[[Tokens], object], dispatcher: Dispatcher,
                       experts: ExpertsContract, *, agree_group=None, what: str = "this MoE layer", chunks: int = 1,
                       side: nn.Module | None = None, copy_meta: Tensor | None = None,
                       row_tags: Tensor | None = None):
    """(routing, y [T, H] or (y, side(h))): ``route(tokens)`` -> the agreement -> ``dispatcher``.
    ``side`` (shared experts) runs while the first chunks are in flight; ``copy_meta`` travels with
    each copy, ``row_tags`` reach the experts' capture."""
    def dispatch(routing):
        return dispatcher(tokens.h, routing.expert_idx, routing.gates, experts, copy_meta=copy_meta,
                          row_tags=row_tags, tag=tokens.tag, problem=tokens.problem, chunks=chunks, side=side)

    def routed(t: Tokens):
        with stage("route"):
            return route(t)

    if not dispatcher.exchanges and agree_group is None:
        routing = routed(tokens)
        return routing, dispatch(routing)
    return route_agreed(tokens, router, routed, agree_group, what, then=dispatch)


def route_agreed(tokens: Tokens, router, route: Callable[[Tokens], object], agree_group, what: str, then=None):
    """``route(tokens)`` inside the agreement. With ``then`` (our dispatch, whose exchange carries the
    agreement), returns (routing, then(routing)), and agrees over ``agree_group`` too when one is
    given (ranks beyond the exchange). Without it (the engine's own exchange follows), agrees over
    ``agree_group`` (None: this process alone) and returns the routing."""
    with agreed_routing(router):
        routing = route(tokens)
        if then is None or agree_group is not None:
            agree(tokens.problem, tokens.tag, agree_group, what)
        return routing if then is None else (routing, then(routing))
