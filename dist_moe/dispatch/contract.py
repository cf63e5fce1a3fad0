"""The two contracts every MoE layer here is built from (Megatron-core's router / token dispatcher
/ experts split): a dispatcher moves routed tokens to their experts and back; experts compute
on the rows that arrived. ``MoELayer`` and both engines' layers hold one of each. What a dispatcher
takes: one forward's ``Tokens`` (made once by ``tokens_in``) and their ``Routes``.

Dispatchers: ``LocalDispatcher`` (every expert on this rank: nothing exchanged) and
``ExpertParallelDispatcher`` (over a process group; rank or node dedup; pipelined by chunk),
both in ``dispatcher.py``; ``make_dispatcher`` picks one. Experts: dist-moe's ``Experts``,
``MegatronExperts`` (Megatron's SequentialMLP) and ``DeepSpeedExperts`` (DeepSpeed's copies).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor, nn

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


def per_token(t: Tensor | None, shape, name: str) -> Tensor | None:
    """Flatten a per-token tensor for inputs of ``shape``; a [B] tensor for [B, S, H] inputs is repeated
    per position."""
    if t is None:
        return None
    lead = shape[:-1]
    if t.shape == lead:
        return t.reshape(-1)
    if len(lead) == 2 and t.shape == lead[:1]:
        return t.unsqueeze(1).expand(lead).reshape(-1)
    raise ValueError(f"{name} must have shape {tuple(lead)} (or [B] per sequence), got {tuple(t.shape)}")


class Routes(Protocol):
    """What an exchange reads of a routing (``dist_moe.routing.Routing`` has it): [T, K] expert ids, highest
    first, -1 for a slot dropped by capacity, and the gates applied to the selected experts' outputs."""

    expert_idx: Tensor
    gates: Tensor


class ExpertsContract(Protocol):
    """Rows grouped by local expert in, one output row per input row out."""

    num_experts: int  # local experts on this rank
    capture: object | None  # GAR's factor capture (dist-moe's Experts only), else None
    # (optional, default False) whether a call takes ``weights={slot: tensor}``, copies of its weights to run
    # on: the pipeline casts dist-moe's experts' weights once per forward for all chunks

    def __call__(self, x: Tensor, counts: list[int] | Tensor, tags: Tensor | None = None) -> Tensor:
        """``counts``: rows per local expert: an int tensor on x's device where ``grouped(x)``, else a list."""
        ...

    def grouped(self, x: Tensor) -> bool:
        """Whether a call on rows like ``x`` runs grouped GEMMs, which take their counts on the device
        (counted there from the pairs: no host read) instead of a host list."""
        ...

    def template(self) -> dict[str, Tensor]:
        """The trainable tensors the dispatch's backward returns gradients for."""
        ...


class Dispatched(Protocol):
    """A routed batch whose routes have been sent: the experts' half of the exchange."""

    def experts_and_combine(self, experts: ExpertsContract,
                            shared: nn.Module | None = None) -> tuple[Tensor, Tensor | None]:
        """Payload out, ``experts`` on what arrived, gated outputs combined back per token: (y [T, H],
        ``shared(h)`` or None). One call for the three, so the pipelined implementation can run one
        chunk's experts while the others' exchanges are in flight."""
        ...


class Dispatcher(Protocol):
    """dispatch a routed batch by its ``DispatchPlan`` -> run ``experts`` on what arrived -> combine the
    gated outputs back per token."""

    exchanges: bool  # True: other ranks take part, and the exchange's header carries the agreement
    rank: int
    metadata_bytes: int

    def dispatch(self, tokens: Tokens, routing: Routes, chunks: int = 1) -> Dispatched:
        """``tokens.h`` [T, H], ``routing.expert_idx`` / ``routing.gates`` [T, K] (-1: dropped): the
        routes sent, every rank knowing what it receives."""
        ...

    def __call__(self, tokens: Tokens, routing: Routes, experts: ExpertsContract, chunks: int = 1,
                 shared: nn.Module | None = None) -> tuple[Tensor, Tensor | None]:
        """``dispatch`` then ``experts_and_combine``."""
        ...

    @property
    def traffic(self) -> Tensor:
        """[W, W] int64 payload bytes this rank sent to each peer since the last reset (its row)."""
        ...

    def reset_traffic(self) -> None: ...


@runtime_checkable
class CountsBytes(Protocol):
    """A layer whose tokens move through dist-moe's dispatcher (its ``traffic`` is its exchange's): what
    the trainer's byte log, the routing record and the benchmarks ask for."""

    topology: object  # placement.Topology
    placement: object  # placement.Placement
    dedup: str
    exchange: object  # dispatch.exchange.ExpertExchange: its dispatcher's row_bytes, what one copy sent

    @property
    def traffic(self):
        """placement.Traffic: payload bytes this rank sent since the last reset."""
        ...

    def reset_traffic(self) -> None: ...
