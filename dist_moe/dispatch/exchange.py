"""The exchange stage every MoE forward shares: its tokens to their experts and back, and the agreement
its route stage runs inside. Each host's forward reads as its stages (``MoELayer``, DeepSpeed's and
Megatron's layers through dist-moe's dispatcher):

    tokens = self.tokens(x, ...)
    with self.exchange.agreement(router):
        with stage("route"):
            routing = self.route(tokens)
        y, shared = self.exchange.run(tokens, routing, experts, shared=...)
    self.record(tokens, routing)

Agreement (``agree.py``): with an exchanging dispatcher the ranks agree on bad input and on being at
the same forward in the header of the first exchange; ranks beyond the exchange that route their own
tokens (data parallelism in an engine) agree with one small all-reduce over ``agree_group`` first.
Inside the agreement the router leaves its input checks to it, and a refusal restores the router's
buffers. Alone (a local dispatcher, no wider group) the router checks its own input.
"""
from __future__ import annotations

import contextlib

from torch import Tensor, nn

from dist_moe.dispatch.agree import agree, agreed_routing
from dist_moe.dispatch.contract import Dispatcher, ExpertsContract
from dist_moe.dispatch.moe_forward import Tokens


class ExpertExchange:
    """One layer's dispatcher as its forward's exchange stage (``what`` names the layer in refusals)."""

    def __init__(self, dispatcher: Dispatcher, agree_group=None, what: str = "this MoE layer"):
        self.dispatcher, self.agree_group, self.what = dispatcher, agree_group, what

    @property
    def agreed(self) -> bool:
        """Whether the route stage runs inside the agreement (anything beyond this process takes part)."""
        return self.dispatcher.exchanges or self.agree_group is not None

    def agreement(self, router) -> contextlib.AbstractContextManager:
        """The context the route and exchange stages run in: ``agreed_routing`` when ranks agree."""
        return agreed_routing(router) if self.agreed else contextlib.nullcontext()

    def run(self, tokens: Tokens, routing, experts: ExpertsContract, *, chunks: int = 1,
            shared: nn.Module | None = None, copy_meta: Tensor | None = None,
            row_tags: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """(y [T, H] the gated experts' outputs summed per token, ``shared(h)`` or None). ``shared`` (the
        shared experts) runs while the first chunks are in flight; ``copy_meta`` travels with each copy,
        ``row_tags`` reach the experts' capture."""
        if self.agree_group is not None:  # ranks beyond the exchange: one small all-reduce first
            agree(tokens.problem, tokens.tag, self.agree_group, self.what)
        out = self.dispatcher(tokens.h, routing.expert_idx, routing.gates, experts, copy_meta=copy_meta,
                              row_tags=row_tags, tag=tokens.tag, problem=tokens.problem, chunks=chunks, side=shared)
        if shared is None:
            assert isinstance(out, Tensor)  # the dispatcher returns (y, shared(h)) only when given shared
            return out, None
        y, side = out
        return y, side
