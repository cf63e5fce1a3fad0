"""Any dist-moe routing strategy as a megatron-core MoE router (written against 0.16.1).

``DistMoERouter`` meets Megatron's router interface: built as
``router(config=..., pg_collection=...)``, called as ``router(hidden [S, B, H],
padding_mask [S, B])`` with True at padding (what megatron-core 0.16.1's code does:
``compute_routing_scores_for_aux_loss``, ``_apply_expert_bias``, GPTModel and
TransformerLayer all invert it to find valid tokens, though two of its docstrings say
True=valid), it returns ``probs [T, E]`` (the gates of the
selected experts, zero elsewhere) and a bool ``routing_map [T, E]``. The
strategy's aux loss rides on ``probs`` through Megatron's
``MoEAuxLossAutoScaler``, so it reaches the router in the same backward.
Use it through the spec:

    spec = get_moe_module_spec(use_te=False, num_experts=E)
    spec.submodules.router = functools.partial(DistMoERouter, router={"type": "branch", ...})

(``megatron.megatron_moe_layer`` does that). Megatron keeps experts contiguous (slot s on
EP rank s // (E/ep)); a dist-moe placement is honoured by relabelling the
columns, so the experts Megatron holds on EP rank r are
``placement.local_experts(r)`` in order. The router's statistics (BRANCH
anchors, DeepSeek-V3 loads) are summed over the data-parallel group, whose
ranks hold different tokens. Categories and token ids come from
``routing_context`` in Megatron's [S, B] token order.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

import dist_moe.integrations.megatron.patches as megatron_patches
from dist_moe.dispatch.contract import Tokens
from dist_moe.distributed.groups import WeakGroup
from dist_moe.integrations.context import context_tokens, routing_extras
from dist_moe.moe.cluster import bind_to_topology
from dist_moe.moe.forward import LastForward, agreed_route
from dist_moe.optional_engines import engine_import
from dist_moe.routing import ROUTERS as ROUTER_TYPES
from dist_moe.routing import Router
from dist_moe.routing.registry import RouterConfig, accepted_keys, layer_router
from placement import Placement


class DistMoERouter(nn.Module):
    agree_group = WeakGroup()  # the ranks that route their own tokens, held weakly (distributed/groups.py)
    track_group = WeakGroup()  # the aux-loss tracker's reduction group, held weakly too

    def __init__(self, *, config, pg_collection=None, router: Router | RouterConfig | dict,
                 placement: Placement | None = None, topology=None):
        super().__init__()
        megatron_patches.apply()
        MoEAuxLossAutoScaler, save_to_aux_losses_tracker = engine_import(
            "megatron.core.transformer.moe.moe_utils", "MoEAuxLossAutoScaler", "save_to_aux_losses_tracker")

        self._attach_aux, self._track = MoEAuxLossAutoScaler.apply, save_to_aux_losses_tracker
        self.config = config
        e, ep = config.num_moe_experts, config.expert_model_parallel_size
        if isinstance(router, dict):  # expert count and top-k come from Megatron's config unless the dict sets them
            router = _with_config_coefficient({"num_experts": e, "top_k": config.moe_router_topk, **router}, config)
        if isinstance(router, (dict, RouterConfig)):
            # every rank that routes its own tokens; tensor-parallel ranks repeat the same tokens,
            # which scales BRANCH's and DeepSeek-V3's sums uniformly and leaves their ratios as they are
            stats = getattr(pg_collection, "tp_dp_cp", None) if pg_collection is not None else None
            router = layer_router(router, config.hidden_size, stats)
        elif aux_coefficient(config) and aux_coefficient(config) != router.aux_loss_coeff:
            raise ValueError(f"config.moe_aux_loss_coeff={aux_coefficient(config)} but the router's aux_loss_coeff "
                             f"is {router.aux_loss_coeff}: set one of them")
        if router.num_experts != e:
            raise ValueError(f"router has {router.num_experts} experts, config.num_moe_experts is {e}")
        if router.top_k != config.moe_router_topk:  # dropless dispatch sizes its buffers as T x topk
            raise ValueError(f"router top_k {router.top_k} != config.moe_router_topk {config.moe_router_topk}")
        placement = placement if placement is not None else Placement.contiguous(e, ep)
        placement.check(e, ep)
        if topology is not None:  # the node boundary for node_limit / subtree_limit by level

            bind_to_topology(router, placement, topology)
        # column p of Megatron's view holds logical expert logical_at[p]
        self.register_buffer("logical_at", torch.argsort(placement.engine_slots()), persistent=False)
        self.router, self.placement = router, placement
        # every rank that routes different tokens agrees on bad input before Megatron's exchanges
        self.agree_group = getattr(pg_collection, "tp_dp_cp", None) if pg_collection is not None else None
        self.track_group = getattr(pg_collection, "tp_cp", None) if pg_collection is not None else None
        self.forwards = 0
        self.layer_number = None
        self.last_forward = LastForward()

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def forward(self, hidden: Tensor, padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # a router's own capacity is the only source of dropped routes: refused by its setting, with no
        # look at the routes (that read would stall a GPU's stream)
        if self.router.capacity_factor is not None:
            raise ValueError(f"router capacity_factor={self.router.capacity_factor}: Megatron's dropless dispatch "
                             "needs every token routed to top_k experts; use Megatron's moe_expert_capacity_factor "
                             "for capacity, not the router's")
        self.forwards += 1
        tokens = self.prepare(hidden, padding_mask, self.forwards)
        # Megatron's own exchange follows: one small all-reduce agrees first (None: this process alone), as a
        # rank that raised alone would leave Megatron's collective order
        routing, _ = agreed_route(tokens, self.routed, self.router, self.agree_group, "DistMoERouter")
        self.record(tokens, routing)
        probs = routing.dense_gates()  # [T, E], gates at the selected experts (the aux loss rides on them)
        routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, routing.expert_idx, True)
        return probs[:, self.logical_at], routing_map[:, self.logical_at]

    def prepare(self, hidden: Tensor, padding_mask: Tensor | None, tag: int) -> Tokens:
        """This forward's tokens, flat ([S, B] order; categories / token ids from ``routing_context``;
        padding out of the statistics), tagged with its host's forward count."""
        h = hidden.reshape(-1, hidden.shape[-1])
        extras = routing_extras(h.shape[0], tuple(hidden.shape[:-1]), "[S, B]")
        valid = None if padding_mask is None else ~padding_mask.reshape(-1).bool()  # padding: out of statistics
        return context_tokens(h, extras, valid, tag, self.router.num_categories)

    def routed(self, tokens: Tokens):
        """The strategy's ``Routing`` (logical expert ids) with padding's gates at zero and the aux loss
        attached to the gates (``MoEAuxLossAutoScaler``; scaled by the valid token count under
        calculate_per_token_loss, as Megatron's routers do). Nothing is recorded yet (``record``)."""
        routing, valid = tokens.route(self.router), tokens.valid
        if valid is not None:  # padding keeps its routes (Megatron sizes its buffers as T x topk)
            routing.gates = routing.gates * valid.unsqueeze(1).to(routing.gates.dtype)  # with zero weight
        aux = routing.aux_loss
        if self.router.aux_loss_coeff and getattr(self.config, "calculate_per_token_loss", False):
            aux = aux * (valid.sum() if valid is not None else tokens.h.shape[0])
        routing.gates = self._attach_aux(routing.gates, aux)
        return routing

    def record(self, tokens: Tokens, routing) -> None:
        """Once the ranks agreed and the forward goes on: the aux loss, unscaled, into Megatron's
        per-layer tracker (what ``track_moe_metrics`` logs), this forward's routing and its router input
        (GAR's recomputation)."""
        self.last_forward.keep(tokens, routing)
        coeff = self.router.aux_loss_coeff
        if coeff:
            layers = self.config.num_layers + (getattr(self.config, "mtp_num_layers", None) or 0)
            self._track("load_balancing_loss", routing.aux_loss.detach() / coeff, self.layer_number, layers,
                        reduce_group=self.track_group)

    @property
    def last_routing(self):
        return self.last_forward.routing


def aux_coefficient(config) -> float:
    """The batch-level aux-loss coefficient a Megatron config asks for (``moe_aux_loss_coeff`` of the
    ``aux_loss`` balancing type); other balancing types with a coefficient are refused."""
    kinds = config.moe_router_load_balancing_type
    kinds = kinds if isinstance(kinds, list) else [kinds]
    coeffs = config.moe_aux_loss_coeff
    coeffs = coeffs if isinstance(coeffs, list) else [coeffs] * len(kinds)
    out = 0.0
    for kind, c in zip(kinds, coeffs):
        if c and kind != "aux_loss":
            raise ValueError(f"config.moe_router_load_balancing_type={kind!r} with coefficient {c}: dist-moe's "
                             "strategies give Megatron's batch-level 'aux_loss' only")
        out = float(c) if c else out
    return out


def _with_config_coefficient(router: dict, config) -> dict:
    """The router dict with Megatron's ``config.moe_aux_loss_coeff`` as its aux-loss coefficient."""
    coeff, kind = aux_coefficient(config), router.get("type")
    if not coeff:
        return router
    if kind in ROUTER_TYPES and "aux_loss_coeff" not in accepted_keys(kind):
        raise ValueError(f"config.moe_aux_loss_coeff={coeff}, but router type {kind!r} has no auxiliary loss "
                         "(it balances load its own way): set config.moe_aux_loss_coeff=0")
    given = router.get("aux_loss_coeff")
    if given is not None and float(given) != coeff:
        raise ValueError(f"router aux_loss_coeff={given} and config.moe_aux_loss_coeff={coeff} disagree: "
                         "set the coefficient in one place (Megatron's config)")
    return {**router, "aux_loss_coeff": coeff}
