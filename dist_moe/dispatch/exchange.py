"""The dispatch and combine stages every MoE forward shares: its tokens to their experts and back
(``ExpertExchange``, built from an ``ExchangeConfig``), the agreement its route stage runs inside, and
the bytes it sent. The forward that uses it is ``dist_moe/moe/forward.py``.

Agreement (``agree.py``): with an exchanging dispatcher the ranks agree on bad input and on being at
the same forward in the header of the first exchange; ranks beyond the exchange that route their own
tokens (data parallelism in an engine) agree with one small all-reduce over ``agree_group`` first.
Inside the agreement the router leaves its input checks to it, and a refusal restores the router's
buffers. Alone (a local dispatcher, no wider group) the router checks its own input.
"""
from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass

from dist_moe.dispatch.agree import agree, agreed_routing
from dist_moe.dispatch.contract import Dispatcher, Routes, Tokens
from dist_moe.dispatch.dispatcher import make_dispatcher
from dist_moe.dispatch.pipeline import check_chunks
from dist_moe.dispatch.wire import check_wire_dtype
from dist_moe.distributed.groups import WeakGroup
from placement import Placement, Topology, Traffic
from placement.plan import check_dedup


@dataclass(frozen=True)
class ExchangeConfig:
    """How one layer's tokens reach their experts through dist-moe's dispatcher.

    ``dedup``: each token once per destination rank, once per destination node, or once per expert
    (none). ``pipeline_chunks`` C > 1 cuts each rank's tokens into C chunks whose exchanges are in
    flight while the experts run others (the same C on every rank). ``deterministic`` sums each
    token's expert outputs, and the gradient rows of its copies, in a fixed order instead of with
    index_add, whose atomics on a GPU add them in any order: a rerun repeats bit for bit, for an extra
    pass over the [T * K, H] rows. ``timeout`` bounds the collectives of the groups the exchange
    creates (node dedup's per-node groups; the main group's is set where it was created). ``wire_dtype``:
    the dtype rows travel in (``wire.py``; auto: the dtype the experts compute in)."""

    dedup: str = "rank"
    pipeline_chunks: int = 1
    deterministic: bool = False
    timeout: datetime.timedelta | None = None
    wire_dtype: str = "auto"

    def __post_init__(self):
        check_dedup(self.dedup)
        check_wire_dtype(self.wire_dtype)
        check_chunks(self.pipeline_chunks)

    def build(self, group, placement: Placement, topology: Topology, agree_group=None,
              what: str = "this MoE layer") -> ExpertExchange:
        """The exchange over ``group`` (None: every expert on this rank, nothing exchanged)."""
        dispatcher = make_dispatcher(group, placement, topology, self.dedup, self.timeout, self.deterministic,
                                     self.wire_dtype)
        return ExpertExchange(dispatcher, self.pipeline_chunks, agree_group, what)


class ExpertExchange:
    """One layer's dispatcher as its forward's dispatch and combine (``what`` names the layer in refusals).
    ``chunks`` may change between forwards (``train/chunk_tuning.py``), the same on every rank."""

    agree_group = WeakGroup()  # held weakly: torch.distributed owns the group (groups.py)

    def __init__(self, dispatcher: Dispatcher | None, chunks: int = 1, agree_group=None,
                 what: str = "this MoE layer"):
        self.dispatcher, self.chunks, self.what = dispatcher, check_chunks(chunks), what
        self.agree_group = agree_group

    @property
    def agreed(self) -> bool:
        """Whether the route stage runs inside the agreement (anything beyond this process takes part)."""
        return self.dispatcher is not None and self.dispatcher.exchanges or self.agree_group is not None

    def agreement(self, router) -> contextlib.AbstractContextManager:
        """The context the route, dispatch and combine stages run in: ``agreed_routing`` when ranks agree."""
        return agreed_routing(router) if self.agreed else contextlib.nullcontext()

    def dispatch(self, tokens: Tokens, routing: Routes):
        """The tokens' routes sent (the payload's hops planned): ``experts_and_combine`` of what it returns
        moves the payload, runs the experts and brings their outputs back."""
        if self.dispatcher is None:
            raise ValueError(f"{self.what} has no expert-parallel group to exchange over yet")
        if self.agree_group is not None:  # ranks beyond the exchange: one small all-reduce first
            assert tokens.problem is not None and tokens.tag is not None  # tokens_in sets both
            agree(tokens.problem, tokens.tag, self.agree_group, self.what)
        return self.dispatcher.dispatch(tokens, routing, self.chunks)

    def traffic(self, topology: Topology) -> Traffic:
        """Payload bytes this rank sent in forward dispatch since the last reset (its row)."""
        if self.dispatcher is None:
            return Traffic.zeros(topology)
        return Traffic(self.dispatcher.traffic.clone(), topology)

    def reset_traffic(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.reset_traffic()
