"""The two contracts every MoE layer here is built from (Megatron-core's router / token dispatcher
/ experts split): a dispatcher moves routed tokens to their experts and back; experts compute
on the rows that arrived. ``MoELayer`` and both engines' layers hold one of each.

Dispatchers: ``LocalDispatcher`` (every expert on this rank: nothing exchanged) and
``ExpertParallelDispatcher`` (over a process group; rank or node dedup; pipelined by chunk),
both in ``dispatcher.py``; ``make_dispatcher`` picks one. Experts: dist-moe's ``Experts``,
``MegatronExperts`` (Megatron's SequentialMLP) and ``DeepSpeedExperts`` (DeepSpeed's copies).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor, nn

from dist_moe.dispatch.moe_forward import Tokens


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


class Dispatcher(Protocol):
    """dispatch a routed batch by its ``DispatchPlan`` -> run ``experts`` on what arrived -> combine the
    gated outputs back per token. One call does all three, so the pipelined implementation can run
    one chunk's experts while the others' exchanges are in flight."""

    exchanges: bool  # True: other ranks take part, and the exchange's header carries the agreement
    rank: int
    metadata_bytes: int

    def __call__(self, tokens: Tokens, routing: Routes, experts: ExpertsContract, chunks: int = 1,
                 shared: nn.Module | None = None) -> tuple[Tensor, Tensor | None]:
        """``tokens.h`` [T, H], ``routing.expert_idx`` / ``routing.gates`` [T, K] (-1: dropped) ->
        (y [T, H], ``shared(h)`` or None)."""
        ...

    @property
    def traffic(self) -> Tensor:
        """[W, W] int64 payload bytes this rank sent to each peer since the last reset (its row)."""
        ...

    def reset_traffic(self) -> None: ...


@runtime_checkable
class CountsBytes(Protocol):
    """A layer whose tokens move through dist-moe's dispatcher (``CountsTraffic``, the engines'
    dispatched hosts): what the trainer's byte log, the routing record and the benchmarks ask for."""

    topology: object  # placement.Topology
    placement: object  # placement.Placement
    dedup: str

    @property
    def traffic(self):
        """placement.Traffic: payload bytes this rank sent since the last reset."""
        ...

    def reset_traffic(self) -> None: ...
