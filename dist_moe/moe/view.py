"""Finding a model's MoE layers, whichever engine hosts them, and what callers read from each.

Every MoE layer (dist-moe's ``MoELayer``, ``DeepSpeedHostedMoE``, ``MegatronHostedMoE``) has
``moe_view()``; ``moe_layers(model)`` is the one way the trainer, metrics, checkpoints and GAR
find them, in module order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dist_moe.dispatch.contract import CountsBytes


@dataclass
class MoEView:
    """One MoE layer's router, expert parameters and last inputs (``layer.moe_view()``).

    ``template`` maps each slot of the common expert template to the parameters that
    hold it on this rank: one stacked [E_local, ...] tensor (dist-moe), one [1, ...]
    tensor per expert (DeepSpeed's expert copies; both ``stacked``), or one plain
    tensor per expert (Megatron). ``experts`` is dist-moe's ``Experts`` where block
    factors can be captured (GAR's Gram mode, example and token units), else None.
    """

    router: object
    template: dict
    stacked: bool
    local_params: list  # the parameters this rank holds alone: its experts
    last_forward: object  # the layer's LastForward: ``inputs()`` (router input [T, H], extras, layout) once kept
    group: object = None  # the expert-parallel process group, None when every expert is local
    rank: int = 0
    experts: object = None

    def slot_numel(self) -> list[int]:
        return [(ps[0][0] if self.stacked else ps[0]).numel() for ps in self.template.values()]


@runtime_checkable
class MoEHost(Protocol):
    """What the trainer, metrics, checkpoints and GAR ask of every MoE layer, whichever engine hosts it."""

    num_experts: int
    expert_node: object  # [E] each expert's node when the layer knows several nodes, else None
    expert_rank: object  # [E] each expert's rank under expert parallelism, else None

    def moe_view(self) -> MoEView: ...

    def expert_state_keys(self, prefix: str = "") -> dict:
        """{state-dict key of a local expert tensor: (global expert ids, checkpoint stem, stacked)}."""
        ...


def expert_locations(placement, topology) -> tuple:
    """(``expert_node``, ``expert_rank``) as every MoE host gives them: [E] each expert's node when the
    topology has several nodes, [E] each expert's rank under expert parallelism; None where not (or
    where the placement or topology is not known)."""
    if placement is None:
        return None, None
    node = placement.expert_nodes(topology) if topology is not None and topology.num_nodes > 1 else None
    return node, placement.rank_table() if placement.world_size > 1 else None


def bytes_counter(layer):
    """What counts the bytes dist-moe's dispatcher moved for ``layer``: the layer itself (dist-moe's, the
    transformers host), the engine layer it hosts (``layer.dispatched``: DeepSpeed's or Megatron's MoE
    layer through dist-moe's dispatcher), or None (an engine's own dispatcher)."""
    inner = getattr(layer, "dispatched", layer)
    return inner if isinstance(inner, CountsBytes) else None


def moe_layers(model) -> list[MoEHost]:
    """Every MoE layer module in ``model`` (dist-moe's, or DeepSpeed- or Megatron-hosted)."""
    return [m for m in model.modules() if isinstance(m, MoEHost)]


def moe_views(model) -> list[MoEView]:
    """``moe_view()`` of every MoE layer in ``model``."""
    return [m.moe_view() for m in moe_layers(model)]
