"""Routes a model's own router chose: the route stage of hosts that sit behind it (transformers' experts
modules, called as ``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])``).
"""
from __future__ import annotations

import contextlib

from torch import Tensor

from dist_moe.dispatch.contract import Tokens, tokens_in
from dist_moe.routing.base import Routing, expert_load


class ChosenRouter:
    """A model's own router as the agreement and the trainer see a dist-moe router: no buffers to
    restore, no input checks to take over, nothing scheduled, no extra inputs (its parameters train
    with the rest of the model)."""

    scheduled = False
    inputs: tuple = ()
    num_categories = None

    def __init__(self, name: str, num_experts: int):
        self.name, self.num_experts = name, num_experts

    def buffers(self) -> list:
        return []

    def checks_by_caller(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def restored_on(self, *errors: type[BaseException]) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def chosen_tokens(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, tag: int) -> Tokens:
    """The tokens with the model's choice riding along (``chosen_route`` reads it)."""
    tokens = tokens_in(hidden_states, tag)
    tokens.chosen = (top_k_index, top_k_weights)
    return tokens


def chosen_route(tokens: Tokens) -> Routing:
    """The model's choice as the exchange takes it: expert ids and weights (the rest of a ``Routing``,
    which only a host that keeps it needs, is ``kept_routing``'s)."""
    assert tokens.chosen is not None  # made by chosen_tokens()
    index, weights = tokens.chosen
    nothing = weights.new_zeros(0)
    return Routing(nothing, index.long(), weights, nothing, {})


def kept_routing(routing: Routing, num_experts: int) -> Routing:
    """The routing diagnostics read, detached: the chosen weights stand for the full distribution, which
    the model's router keeps to itself; no aux loss; each expert's load."""
    idx, gates = routing.expert_idx, routing.gates.detach().float()
    dense = gates.new_zeros(idx.shape[0], num_experts).scatter(1, idx, gates)
    return Routing(dense, idx, gates, gates.new_zeros(()), {"load": expert_load(idx, num_experts)})
