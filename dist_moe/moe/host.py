"""The forward every MoE host shares whose tokens travel through dist-moe's dispatcher, as its stages:

    tokens = self.tokens(*inputs)                  # checked, flat, with what travels with them
    with self.exchange.agreement(self.strategy):
        with stage("route"):
            routing = self.route(tokens)           # the strategy, capacity, ablation, padding
        y, shared = self.exchange.run(tokens, routing, self.routed_experts, self.shared())
    self.record(tokens, routing)                   # what diagnostics, metrics and GAR read afterwards

``ExchangedMoE`` is that forward; its hosts say how their inputs become ``Tokens`` (``tokens``), how the
tokens are routed (``route``) and what they keep (``record``): dist-moe's ``MoELayer``, DeepSpeed's and
Megatron's MoE layers through dist-moe's dispatcher, and the transformers hosts, whose model's own
router chose before the layer (``ChosenRoutes``). Each host's own ``forward`` keeps its engine's
signature and shapes what ``run_stages`` returns.
"""
from __future__ import annotations

import contextlib

from torch import Tensor, nn

from dist_moe.dispatch.contract import ExpertsContract, Tokens, tokens_in
from dist_moe.dispatch.exchange import ExpertExchange
from dist_moe.dispatch.stages import stage
from dist_moe.routing.base import Router, Routing, expert_load
from placement import Placement, Topology


class ExchangedMoE:
    """Mixed into each host's module class: the staged forward over ``self.exchange`` (an
    ``ExpertExchange``) and ``self.routed_experts`` (an ``ExpertsContract``)."""

    exchange: ExpertExchange
    routed_experts: ExpertsContract
    forwards = 0  # the exchanges' tag: counted before anything can raise (dist_moe/dispatch/agree.py)

    def tokens(self, *inputs) -> Tokens:
        """This forward's inputs as ``Tokens`` (tagged ``self.forwards``)."""
        raise NotImplementedError

    def route(self, tokens: Tokens) -> Routing:
        """The tokens' ``Routing`` (logical expert ids), inside the ranks' agreement."""
        raise NotImplementedError

    def record(self, tokens: Tokens, routing: Routing) -> None:
        """What the host keeps once the forward went through (nothing, by default)."""

    @property
    def strategy(self):
        """The router whose input checks the agreement takes over and whose buffers a refusal restores."""
        raise NotImplementedError

    def shared(self) -> nn.Module | None:
        """The shared experts, run while the first chunks are in flight (None: none)."""
        return None

    def run_stages(self, *inputs) -> tuple[Tensor, Routing]:
        """(y [T, H] the routed and shared experts' outputs per token, the forward's routing)."""
        self.forwards += 1
        tokens = self.tokens(*inputs)
        with self.exchange.agreement(self.strategy):
            with stage("route"):
                routing = self.route(tokens)
            y, shared = self.exchange.run(tokens, routing, self.routed_experts, self.shared())
        self.record(tokens, routing)
        return (y if shared is None else y + shared), routing

    @property
    def dispatcher(self):
        """The exchange's dispatcher (its bytes: ``CountsTraffic``)."""
        return self.exchange.dispatcher

    @dispatcher.setter
    def dispatcher(self, dispatcher) -> None:  # another dispatcher over the same experts (benchmarks, checks)
        self.exchange.dispatcher = dispatcher

    @property
    def pipeline_chunks(self) -> int:
        return self.exchange.chunks

    @pipeline_chunks.setter
    def pipeline_chunks(self, chunks: int) -> None:
        self.exchange.chunks = chunks


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


class ChosenRoutes(ExchangedMoE):
    """The stages of an experts module that a model's own router called with its choice
    (transformers: ``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])``)."""

    router: ChosenRouter
    num_experts: int

    @property
    def strategy(self) -> ChosenRouter:
        return self.router

    def tokens(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tokens:
        tokens = tokens_in(hidden_states, self.forwards)
        tokens.chosen = (top_k_index, top_k_weights)
        return tokens

    def route(self, tokens: Tokens) -> Routing:
        """The model's choice as the exchange takes it: expert ids and weights (the rest of a ``Routing``,
        which only a host that keeps it needs, is ``kept_routing``'s)."""
        assert tokens.chosen is not None  # made by tokens()
        index, weights = tokens.chosen
        nothing = weights.new_zeros(0)
        return Routing(nothing, index.long(), weights, nothing, {})

    def kept_routing(self, routing: Routing) -> Routing:
        """The routing diagnostics read, detached: the chosen weights stand for the full distribution, which
        the model's router keeps to itself; no aux loss; each expert's load."""
        idx, gates = routing.expert_idx, routing.gates.detach().float()
        dense = gates.new_zeros(idx.shape[0], self.num_experts).scatter(1, idx, gates)
        return Routing(dense, idx, gates, gates.new_zeros(()), {"load": expert_load(idx, self.num_experts)})


def bind_to_topology(router: Router, placement: Placement, topology: Topology) -> None:
    """Tell a router the cluster's node boundary, where its config asks for it: DeepSeek-V3's
    ``node_limit`` groups (the experts of each node), BRANCH's ``subtree_limit`` by level (the
    tree depth of each level's units under tree-prefix placement). The engine hosts call it too."""
    if (router.node_limit or router.needs_topology) and topology.world_size != placement.world_size:
        raise ValueError(f"topology {topology.describe()} has {topology.world_size} ranks but the expert-parallel "
                         f"group has {placement.world_size}: give the EP group's topology")
    if router.node_limit:
        router.set_expert_groups(placement.expert_nodes(topology))
    if router.needs_topology:
        tree = placement == Placement.tree_prefix(router.num_experts, topology)
        router.resolve_subtree_levels(topology.levels, topology.sizes, tree)


def per_token(t: Tensor | None, shape, name: str) -> Tensor | None:
    """Flatten a per-token tensor; a [B] tensor for [B, S, H] inputs is repeated per position."""
    if t is None:
        return None
    lead = shape[:-1]
    if t.shape == lead:
        return t.reshape(-1)
    if len(lead) == 2 and t.shape == lead[:1]:
        return t.unsqueeze(1).expand(lead).reshape(-1)
    raise ValueError(f"{name} must have shape {tuple(lead)} (or [B] per sequence), got {tuple(t.shape)}")

