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

(``megatron_moe_layer`` does that). Megatron keeps experts contiguous (slot s on
EP rank s // (E/ep)); a dist-moe placement is honoured by relabelling the
columns, so the experts Megatron holds on EP rank r are
``placement.local_experts(r)`` in order. The router's statistics (BRANCH
anchors, DeepSeek-V3 loads) are summed over the data-parallel group, whose
ranks hold different tokens. Categories and token ids come from
``routing_context`` in Megatron's [S, B] token order.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from dist_moe.dispatch.agree import agree, agreed_routing, input_problem
from dist_moe.dispatch.groups import WeakGroup
from dist_moe.integrations import megatron_patches
from dist_moe.integrations.context import routing_extras
from dist_moe.integrations.hosted import HostedMoE
from dist_moe.routing import ROUTERS as ROUTER_TYPES
from dist_moe.routing import Router, build_router
from dist_moe.routing.registry import router_shape
from placement import Placement

DISPATCHERS = ("alltoall", "allgather")


class DistMoERouter(nn.Module):
    agree_group = WeakGroup()  # the ranks that route their own tokens, held weakly (dispatch/groups.py)
    track_group = WeakGroup()  # the aux-loss tracker's reduction group, held weakly too

    def __init__(self, *, config, pg_collection=None, router: Router | dict, placement: Placement | None = None,
                 topology=None):
        super().__init__()
        megatron_patches.apply()
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

        self._attach_aux, self._track = MoEAuxLossAutoScaler.apply, save_to_aux_losses_tracker
        self.config = config
        e, ep = config.num_moe_experts, config.expert_model_parallel_size
        if isinstance(router, dict):
            router = _with_config_coefficient(router, config)
            # every rank that routes its own tokens; tensor-parallel ranks repeat the same tokens,
            # which scales BRANCH's and DeepSeek-V3's sums uniformly and leaves their ratios as they are
            stats = getattr(pg_collection, "tp_dp_cp", None) if pg_collection is not None else None
            # hidden size, expert count and top-k come from Megatron's config unless the dict sets them
            router = build_router({"hidden_size": config.hidden_size, "num_experts": e,
                                   "top_k": config.moe_router_topk, **router}, stats_group=stats)
        elif aux_coefficient(config) and aux_coefficient(config) != getattr(router, "aux_loss_coeff", 0.0):
            raise ValueError(f"config.moe_aux_loss_coeff={aux_coefficient(config)} but the router's aux_loss_coeff "
                             f"is {getattr(router, 'aux_loss_coeff', None)}: set one of them")
        if router.num_experts != e:
            raise ValueError(f"router has {router.num_experts} experts, config.num_moe_experts is {e}")
        if router.top_k != config.moe_router_topk:  # dropless dispatch sizes its buffers as T x topk
            raise ValueError(f"router top_k {router.top_k} != config.moe_router_topk {config.moe_router_topk}")
        placement = placement if placement is not None else Placement.contiguous(e, ep)
        placement.check(e, ep)
        per_rank = e // ep
        if any(len(placement.local_experts(r)) != per_rank for r in range(ep)):
            raise ValueError(f"Megatron holds {per_rank} experts on every EP rank; placement "
                             f"{placement.expert_to_rank} is uneven")
        if topology is not None:  # the node boundary for node_limit / subtree_limit by level
            from dist_moe.layer import bind_to_topology

            bind_to_topology(router, placement, topology)
        physical = placement.rank_tensor() * per_rank + placement.local_slot_tensor()
        # column p of Megatron's view holds logical expert logical_at[p]
        self.register_buffer("logical_at", torch.argsort(physical), persistent=False)
        self.router, self.placement = router, placement
        # every rank that routes different tokens agrees on bad input before Megatron's exchanges
        self.agree_group = getattr(pg_collection, "tp_dp_cp", None) if pg_collection is not None else None
        self.track_group = getattr(pg_collection, "tp_cp", None) if pg_collection is not None else None
        self.forwards = 0
        self.layer_number = None
        self.last_routing = None
        self.last_aux_loss = None
        self.last_router_input, self.last_router_extras = None, {}

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def forward(self, hidden: Tensor, padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        h, extras, valid, problem = self.prepare(hidden, padding_mask)
        with agreed_routing(self.router):  # one small all-reduce: a rank that raised alone would
            routing = self.routed(h, extras, valid)  # leave Megatron's collective order
            agree(problem, self.forwards, self.agree_group, "DistMoERouter")
        if bool((routing.expert_idx < 0).any()):
            raise ValueError("Megatron's dropless dispatch needs every token routed to top_k experts; "
                             "use Megatron's moe_expert_capacity_factor for capacity, not the router's")
        self.record(routing)
        probs = routing.dense_gates()  # [T, E], gates at the selected experts (the aux loss rides on them)
        routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, routing.expert_idx, True)
        return probs[:, self.logical_at], routing_map[:, self.logical_at]

    def prepare(self, hidden: Tensor, padding_mask: Tensor | None) -> tuple:
        """Count this forward and flatten its tokens: (h [T, H], categories / token ids, valid [T]
        or None, the input-problem code the ranks agree on before any exchange)."""
        h = hidden.reshape(-1, hidden.shape[-1])
        extras = routing_extras(h.shape[0], tuple(hidden.shape[:-1]), "[S, B]")
        self.last_router_input, self.last_router_extras = h.detach(), extras  # for GAR's recomputation
        self.forwards += 1
        valid = None if padding_mask is None else ~padding_mask.reshape(-1).bool()  # padding: out of statistics
        return h, extras, valid, input_problem(h, extras.get("categories"), getattr(self.router, "num_categories", None))

    def routed(self, h: Tensor, extras: dict, valid: Tensor | None):
        """The strategy's ``Routing`` of ``h`` (logical expert ids) with padding's gates at zero and the
        aux loss attached to the gates (``MoEAuxLossAutoScaler``; scaled by the valid token count under
        calculate_per_token_loss, as Megatron's routers do). Nothing is recorded yet (``record``)."""
        routing = self.router(h, valid=valid, **extras)
        if valid is not None:  # padding keeps its routes (Megatron sizes its buffers as T x topk)
            routing.gates = routing.gates * valid.unsqueeze(1).to(routing.gates.dtype)  # with zero weight
        aux = routing.aux_loss
        if getattr(self.router, "aux_loss_coeff", 0.0) and getattr(self.config, "calculate_per_token_loss", False):
            aux = aux * (valid.sum() if valid is not None else h.shape[0])
        routing.gates = self._attach_aux(routing.gates, aux)
        return routing

    def record(self, routing) -> None:
        """Once the ranks agreed and the forward goes on: the aux loss, unscaled, into Megatron's
        per-layer tracker (what ``track_moe_metrics`` logs), and this forward's routing."""
        coeff = getattr(self.router, "aux_loss_coeff", 0.0)
        if coeff:
            layers = self.config.num_layers + (getattr(self.config, "mtp_num_layers", None) or 0)
            self._track("load_balancing_loss", routing.aux_loss.detach() / coeff, self.layer_number, layers,
                        reduce_group=self.track_group)
        self.last_routing, self.last_aux_loss = routing.detached(), routing.aux_loss.detach()


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
    from dist_moe.routing.registry import accepted_keys

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


def megatron_config(hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int, ep_size: int = 1,
                    dispatcher: str = "alltoall", expert_type: str = "swiglu", device: torch.device | None = None,
                    **overrides):
    """A TransformerConfig for one MoE layer whose experts compute dist-moe's expert math
    (``top_k`` is the strategy's: Megatron sizes its dropless buffers with it)."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
    if expert_type not in ("swiglu", "gelu"):
        raise ValueError(f"Megatron experts map dist-moe's swiglu or gelu experts, got {expert_type!r}")
    megatron_patches.apply()
    from megatron.core.transformer import TransformerConfig

    cpu = device.type == "cpu" if device is not None else not torch.cuda.is_available()
    fields = dict(
        num_layers=1, hidden_size=hidden_size, num_attention_heads=1, ffn_hidden_size=ffn_hidden_size,
        moe_ffn_hidden_size=ffn_hidden_size, num_moe_experts=num_experts, moe_router_topk=top_k,
        moe_router_pre_softmax=top_k == 1,  # Megatron's check for its own top-1 router; unused here
        expert_model_parallel_size=ep_size, moe_token_dispatcher_type=dispatcher, add_bias_linear=False,
        gated_linear_unit=expert_type == "swiglu",
        activation_func=torch.nn.functional.silu if expert_type == "swiglu" else torch.nn.functional.gelu,
        use_cpu_initialization=cpu, gradient_accumulation_fusion=False, bf16=False, params_dtype=torch.float32,
        # 0: the strategy's own coefficient applies; a coefficient here is Megatron's way to set it
        moe_aux_loss_coeff=0.0,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def megatron_moe_layer(config, router: Router | dict, placement: Placement | None = None, pg_collection=None,
                       topology=None):
    """Megatron's MoELayer (SequentialMLP experts) with a ``DistMoERouter``."""
    megatron_patches.apply()
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    spec.submodules.router = functools.partial(DistMoERouter, router=router, placement=placement, topology=topology)
    return MoELayer(config, submodules=spec.submodules, pg_collection=pg_collection)


def load_dist_moe_experts(layer, experts) -> None:
    """Copy this rank's dist-moe ``Experts`` (same local order) into Megatron's SequentialMLP."""
    local = layer.experts.local_experts
    if len(local) != experts.num_experts:
        raise ValueError(f"Megatron holds {len(local)} local experts, the dist-moe Experts {experts.num_experts}")
    with torch.no_grad():
        for j, mlp in enumerate(local):
            if experts.kind == "swiglu":  # Megatron's GLU: first half of fc1 is the gate
                mlp.linear_fc1.weight.copy_(torch.cat([experts.w_gate[j].t(), experts.w_up[j].t()]))
                mlp.linear_fc2.weight.copy_(experts.w_down[j].t())
            else:
                mlp.linear_fc1.weight.copy_(experts.w_fc1[j].t())
                mlp.linear_fc2.weight.copy_(experts.w_fc2[j].t())


def expert_grads_as_dist_moe(layer, kind: str = "swiglu") -> list[dict]:
    """Per local expert, its gradients in dist-moe's slot names and [in, out] layout."""
    out = []
    for mlp in layer.experts.local_experts:
        g1, g2 = mlp.linear_fc1.weight.grad, mlp.linear_fc2.weight.grad
        if kind == "swiglu":
            gate, up = g1.chunk(2, 0)
            out.append({"w_gate": gate.t(), "w_up": up.t(), "w_down": g2.t()})
        else:
            out.append({"w_fc1": g1.t(), "w_fc2": g2.t()})
    return out


def sent_bytes(layer) -> int:
    """Payload bytes this rank's last alltoall dispatch sent to other EP ranks (from its splits)."""
    dispatcher = layer.token_dispatcher
    splits = getattr(dispatcher, "input_splits", None)
    if splits is None:
        raise ValueError("sent_bytes reads the alltoall dispatcher's input splits after a forward")
    rank = layer.ep_group.rank()
    row = layer.config.hidden_size * layer.config.params_dtype.itemsize
    return sum(int(n) for peer, n in enumerate(splits) if peer != rank) * row


class MegatronHostedMoE(HostedMoE):
    """dist-moe's layer interface over a Megatron-hosted MoE: ``(y, aux) = layer(x, categories, token_ids)``.

    Rows of ``x`` are Megatron's [S, B=1] tokens. The aux loss already reaches the
    router through Megatron's ``MoEAuxLossAutoScaler`` in the output's backward, so
    the returned aux is detached: adding it to a loss reports it without counting
    its gradient twice. Needs ``parallel_state.initialize_model_parallel`` first.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, router: dict, ep_size: int = 1,
                 placement: Placement | None = None, dispatcher: str = "alltoall", expert_type: str = "swiglu",
                 device: torch.device | None = None, topology=None):
        super().__init__()
        shape = router_shape({"hidden_size": hidden_size, **router})  # the router itself is built once, by Megatron
        config = megatron_config(hidden_size, ffn_hidden_size, shape.num_experts, shape.top_k, ep_size,
                                 dispatcher, expert_type, device,
                                 moe_aux_loss_coeff=shape.aux_loss_coeff)  # Megatron's place for it
        self.hidden_size = hidden_size
        self.moe = self._layer(config, router, placement, topology)
        self._know_nodes(self.moe.router.placement, topology)

    def _layer(self, config, router: dict, placement, topology):
        """Megatron's MoELayer with its own token dispatcher (``config.moe_token_dispatcher_type``)."""
        return megatron_moe_layer(config, router, placement, topology=topology)

    @property
    def router(self) -> Router:
        return self.moe.router.router

    @property
    def last_routing(self):
        return self.moe.router.last_routing

    def _run(self, tokens: Tensor, padding: Tensor | None) -> tuple[Tensor, Tensor]:
        # Megatron's [S, B=1, H]; its layer takes the padding mask as [B, S] and transposes it
        y, _ = self.moe(tokens.unsqueeze(1), padding_mask=None if padding is None else padding.unsqueeze(0))
        return y.squeeze(1), self.moe.router.last_aux_loss

    def expert_state_keys(self, prefix: str = "") -> dict:
        """Megatron's local experts, one plain tensor each, under dist-moe's checkpoint stems."""
        ids = self.moe.router.placement.local_experts(self.moe.ep_group.rank())
        return {f"{prefix}moe.experts.local_experts.{j}.{slot}": ([ids[j]], f"{prefix}experts.{slot}", False)
                for j, mlp in enumerate(self.moe.experts.local_experts) for slot, _ in mlp.named_parameters()}

    def moe_view(self):
        """Megatron's SequentialMLP experts as one template, in their own layout (fc1 holds the gate
        and up projections together; GAR: materialized observations)."""
        from dist_moe.moe_view import MoEView

        local = self.moe.experts.local_experts
        template = {"linear_fc1.weight": [m.linear_fc1.weight for m in local],
                    "linear_fc2.weight": [m.linear_fc2.weight for m in local]}
        r = self.moe.router
        ep = self.moe.ep_group if self.moe.ep_group.size() > 1 else None
        return MoEView(self.router, template, False, [p for m in local for p in m.parameters()],
                       lambda: (r.last_router_input, r.last_router_extras, ((r.last_router_input.shape[0],), None)),
                       ep, self.moe.ep_group.rank())
