"""The MoE forward, stage by stage, as every host runs it.

A host's ``forward`` reads top to bottom:

    tokens = <the host's inputs as Tokens>                 # checked, flat, with what travels with them
    y, routing = moe_forward(tokens, route, router, exchange, experts, shared)
    last_forward.keep(tokens, routing)                     # what diagnostics, metrics and GAR read

and ``moe_forward`` is the rest: route, dispatch, experts and combine (and the shared experts, run
while the first chunks are in flight), inside the agreement of every rank that exchanges (a refusal
is raised on every rank, in the header of the first exchange, before a token moves).

Hosts whose engine exchanges the tokens itself (DeepSpeed's all-to-all, Megatron's dispatchers) run
the route stage alone, agreeing with one small all-reduce: ``agreed_route``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor, nn

from dist_moe.dispatch.agree import agree, agreed_routing
from dist_moe.dispatch.contract import ExpertsContract, Tokens
from dist_moe.dispatch.exchange import ExpertExchange
from dist_moe.dispatch.profiling import profiled
from dist_moe.routing.base import Routing

Route = Callable[[Tokens], Routing]


def moe_forward(tokens: Tokens, route: Route, router, exchange: ExpertExchange, experts: ExpertsContract,
                shared: nn.Module | None = None) -> tuple[Tensor, Routing]:
    """(y [T, H] the routed and shared experts' outputs per token, the routing). ``router``: the strategy
    whose input checks the agreement takes over and whose buffers a refusal restores."""
    with exchange.agreement(router):
        with profiled("route"):
            routing = route(tokens)
        dispatched = exchange.dispatch(tokens, routing)
        y, shared_y = dispatched.experts_and_combine(experts, shared)
    return (y if shared_y is None else y + shared_y), routing


def agreed_route(tokens: Tokens, route: Route, router, group, what: str,
                 maxima: Callable[[Routing], tuple] = lambda routing: ()) -> tuple[Routing, list[int]]:
    """The route stage of a host whose engine exchanges the tokens: every rank of ``group`` (None: this
    process alone) agrees on bad input and on being at the same forward with one small all-reduce, which
    also takes the maxima of ``maxima(routing)`` (host ints). Returns (routing, the agreed maxima)."""
    assert tokens.problem is not None and tokens.tag is not None  # tokens_in sets both
    with agreed_routing(router):
        with profiled("route"):
            routing = route(tokens)
        agreed = agree(tokens.problem, tokens.tag, group, what, maxima=maxima(routing))
    return routing, agreed


@dataclass
class LastForward:
    """What a layer's latest forward left for diagnostics, metrics and GAR's recomputation: its routing
    and the router's input, detached (keeping the graph alive would pin activations), the input's extras
    (categories, token ids) and the token layout (shape before flattening, padding mask)."""

    routing: Routing | None = None
    router_input: Tensor | None = None
    extras: dict = field(default_factory=dict)
    layout: tuple | None = None  # None: flat tokens
    no_inputs: str | None = None  # why the router's input is not kept (a model's own router), or None
    # the router's [T, H] input is kept only for a reader that asks (GAR's recomputation): across steps it
    # would hold a layer's activations for nothing
    keep_inputs: bool = False

    def keep(self, tokens: Tokens, routing: Routing, inputs: bool = True) -> None:
        self.routing = routing.detached()
        if inputs:
            self.router_input = tokens.h.detach() if self.keep_inputs else None
            self.extras = tokens.extras
            self.layout = tokens.layout if tokens.layout[0] else None  # hosts that flatten nothing leave it empty

    def inputs(self) -> tuple:
        """(router input [T, H], extras, token layout), as GAR's recomputation reads them."""
        if self.no_inputs is not None:
            raise ValueError(self.no_inputs)
        assert self.router_input is not None, "no forward has kept its input yet (keep_inputs)"
        layout = self.layout if self.layout is not None else ((self.router_input.shape[0],), None)
        return self.router_input, self.extras, layout


class OfExchange:
    """A host's attribute that is its exchange's: ``pipeline_chunks = OfExchange("chunks")`` reads and
    sets ``host.exchange.chunks`` (chunk tuning sets it between forwards, the same on every rank)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, host, owner=None):
        return self if host is None else getattr(host.exchange, self.name)

    def __set__(self, host, value) -> None:
        setattr(host.exchange, self.name, value)


class ExchangeTraffic:
    """A host's ``traffic``: the payload bytes its exchange sent in forward dispatch since the last reset (this
    rank's row), on the host's ``topology``; ``reset_traffic = OfExchange("reset_traffic")`` beside it."""

    def __get__(self, host, owner=None):
        return self if host is None else host.exchange.traffic(host.topology)
