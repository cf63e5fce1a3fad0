"""MoELayer = router + dispatcher + local experts (+ shared expert).

Its forward reads as its stages: tokens -> route (strategy, capacity, ablation) -> dispatch -> experts
-> combine (``forward.py``'s ``moe_forward``, which the engines' layers run too) -> what it keeps. Its
settings are an ``MoELayerConfig``: what the trainer, the engines' hosts
(``DeepSpeedHostedMoE(config, ...)``, ``MegatronHostedMoE(config, ...)``) and the examples pass;
``config.build(group, placement, topology)`` is this layer. The cluster (the process group, the
placement of experts on its ranks, its topology) is not part of the config: it comes from the launch.

With ``group=None`` or a world of one, the dispatcher is local (``LocalDispatcher``: tokens grouped by
expert with one sort, each expert once on its contiguous slice, gated outputs
summed per token: with ``index_add``, or in a fixed order under ``deterministic``).
With a larger group, the router runs on this rank's tokens, and the expert-parallel
dispatcher sends them to the ranks that hold their experts under ``placement``
(default contiguous) over ``topology`` (default: from the launcher's variables).
A router built here from a dict reduces its data-parallel statistics (BRANCH
anchor sums, DeepSeek-V3 loads) over the same group, whose ranks hold
different tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import Tensor, nn

from dist_moe.config.choices import LORA_ALPHA, LORA_RANK, SHARED_EXPERT_HIDDEN
from dist_moe.dispatch.contract import Tokens, per_token, tokens_in
from dist_moe.dispatch.exchange import ExchangeConfig
from dist_moe.distributed.groups import WeakGroup
from dist_moe.distributed.reductions import group_rank, group_size
from dist_moe.moe.cluster import bind_to_topology
from dist_moe.moe.experts import KINDS, Experts, SharedExpert
from dist_moe.moe.forward import ExchangeTraffic, LastForward, OfExchange, moe_forward
from dist_moe.moe.view import MoEView, expert_locations
from dist_moe.routing import Router, Routing
from dist_moe.routing.capacity import capacity_for, capacity_step, check_one_capacity
from dist_moe.routing.registry import RouterConfig, layer_router, router_config
from dist_moe.seeding import per_rank_draw
from placement import Placement, Topology


@dataclass(frozen=True)
class MoELayerConfig:
    """One MoE layer. ``router``: a strategy's config (built per layer) or a built ``Router``;
    ``capacity_factor``: None for dropless; ``shared_expert_hidden`` > 0 adds a shared expert of that
    width; ``expert_type`` swiglu, gelu or lora (``lora_rank``, ``lora_alpha``); ``exchange``: how its
    tokens reach their experts under expert parallelism."""

    hidden_size: int
    ffn_hidden_size: int | None
    router: Router | RouterConfig | dict
    capacity_factor: float | None = None
    shared_expert_hidden: int = SHARED_EXPERT_HIDDEN
    expert_type: str = "swiglu"
    lora_rank: int = LORA_RANK
    lora_alpha: float = LORA_ALPHA
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)

    def __post_init__(self):
        if self.capacity_factor is not None:
            capacity_for(1, 1, 1, self.capacity_factor)  # validates the value
        if self.expert_type not in KINDS:
            raise ValueError(f"expert kind must be one of {KINDS}, got {self.expert_type!r}")

    @classmethod
    def of(cls, hidden_size: int, ffn_hidden_size: int | None, router, **options) -> MoELayerConfig:
        """The config of ``MoELayer(hidden_size, ffn_hidden_size, router, **options)``: ``options`` name
        this config's fields and ``ExchangeConfig``'s (dedup, pipeline_chunks, deterministic, timeout)."""
        exchange_keys = {f.name for f in fields(ExchangeConfig)}
        layer_keys = {f.name for f in fields(cls)} - {"hidden_size", "ffn_hidden_size", "router"}
        for name in options:
            if name not in exchange_keys | layer_keys:
                raise TypeError(f"MoELayer got an unexpected keyword argument {name!r}")
        exchange = options.pop("exchange", None) or ExchangeConfig(
            **{k: options.pop(k) for k in list(options) if k in exchange_keys})
        return cls(hidden_size, ffn_hidden_size, router, exchange=exchange, **options)

    @property
    def num_experts(self) -> int:
        router = self.router
        return router_config(router, ("hidden_size",)).num_experts if isinstance(router, dict) else router.num_experts

    @property
    def expert_options(self) -> dict:
        """What the experts take beyond their sizes and kind."""
        return {"lora_rank": self.lora_rank, "lora_alpha": self.lora_alpha}

    def build(self, group=None, placement=None, topology=None, stats_group=None) -> MoELayer:
        """dist-moe's ``MoELayer`` of this config over ``group`` (None: every expert here), its experts
        placed by ``placement`` (None: contiguous) on ``topology`` (None: the launch's); its router's
        statistics summed over ``stats_group`` (None: ``group``)."""
        options = {f.name: getattr(self, f.name) for f in fields(self)}
        for given in ("hidden_size", "ffn_hidden_size", "router"):
            del options[given]
        return MoELayer(self.hidden_size, self.ffn_hidden_size, self.router, placement, topology, group,
                        stats_group=stats_group, **options)


class MoELayer(nn.Module):
    group = WeakGroup()  # held weakly: torch.distributed owns the group (distributed/groups.py)
    dispatcher = OfExchange("dispatcher")  # benchmarks and checks may put another over the same experts
    pipeline_chunks = OfExchange("chunks")
    traffic = ExchangeTraffic()  # payload bytes this rank sent in forward dispatch since the last reset (its row)
    reset_traffic = OfExchange("reset_traffic")

    def __init__(self, hidden_size: int, ffn_hidden_size: int, router: Router | RouterConfig | dict, placement=None,
                 topology=None, group=None, *, stats_group=None, **options):
        """``options``: the other fields of ``MoELayerConfig`` (capacity_factor, shared_expert_hidden,
        expert_type, lora_rank, lora_alpha) and of ``ExchangeConfig`` (dedup, pipeline_chunks,
        deterministic, timeout), or ``exchange=ExchangeConfig(...)``. Without expert parallelism nothing
        is exchanged and the exchange's settings change nothing but ``deterministic``'s fixed order.
        ``stats_group``: where a router built from a config sums its statistics (None: ``group``); with
        expert-parallel groups smaller than the world, the world, so every replica keeps one router state."""
        super().__init__()
        config = MoELayerConfig.of(hidden_size, ffn_hidden_size, router, **options)
        world = group_size(group)
        router = config.router
        if isinstance(router, (dict, RouterConfig)):
            given = router_config(router, given_later=("hidden_size",))
            if given.hidden_size not in (None, hidden_size):
                raise ValueError(f"router hidden_size {given.hidden_size} != layer hidden_size {hidden_size}")
            stats = stats_group if stats_group is not None else group if world > 1 else None
            router = layer_router(given, hidden_size, stats)
        if not isinstance(router, Router):
            raise ValueError(f"router must be a Router or a config, got {type(router).__name__}")
        check_one_capacity(router, config.capacity_factor)
        e = router.num_experts
        # every check below happens before the first collective
        topology = topology if topology is not None else Topology.launched(world)
        topology.check_ranks(world)
        placement = placement if placement is not None else Placement.contiguous(e, world)
        placement.check(e, world)
        self.config = config
        self.hidden_size = hidden_size
        self.router = router
        self.num_experts = e
        self.placement, self.topology, self.group, self.dedup = placement, topology, group, config.exchange.dedup
        bind_to_topology(router, placement, topology)  # may raise: before the dispatcher creates any group
        rank = group_rank(group)
        self.local_expert_ids = placement.local_experts(rank)
        self.exchange = config.exchange.build(group, placement, topology)
        self.experts = _local_experts(world, rank, len(self.local_expert_ids), hidden_size, ffn_hidden_size,
                                      config.expert_type, **config.expert_options)
        hidden = config.shared_expert_hidden
        self.shared_expert = SharedExpert(hidden_size, hidden) if hidden else None
        self.capacity_factor = config.capacity_factor
        self.ablated_experts: frozenset = frozenset()  # zero-ablation for diagnostics (SpecDrop's Align)
        self.forwards = 0  # the exchanges' tag: counted before anything can raise (dist_moe/dispatch/agree.py)
        self.last_forward = LastForward()

    def forward(self, x: Tensor, categories: Tensor | None = None, token_ids: Tensor | None = None,
                padding_mask: Tensor | None = None):
        """x [..., hidden]; categories / token_ids per token (or [B] per sequence);
        padding_mask [B, S] bool, True at padding (routed like any token, left out of the
        router's statistics: aux loss, loads, anchors, biases; and of per-example summaries such
        as GAR's). Returns (y [..., hidden], the router's aux loss)."""
        self.forwards += 1
        tokens = self.tokens(x, categories, token_ids, padding_mask)
        y, routing = moe_forward(tokens, self.route, self.router, self.exchange, self.experts, self.shared_expert)
        self.last_forward.keep(tokens, routing)
        return y.reshape(x.shape), routing.aux_loss

    def tokens(self, x: Tensor, categories, token_ids, padding_mask) -> Tokens:
        """Checked and flattened: [T, H] tokens and per-token categories, token ids and validity;
        categories travel with each copy, GAR's source tags to the experts' capture."""
        shape = x.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(f"MoELayer input last dim {shape[-1]} != hidden_size {self.hidden_size}")
        if padding_mask is not None and padding_mask.shape != shape[:-1]:
            raise ValueError(f"padding_mask must have shape {tuple(shape[:-1])}, got {tuple(padding_mask.shape)}")
        valid = None if padding_mask is None else ~padding_mask.reshape(-1)  # padding stays out of statistics
        tokens = tokens_in(x.reshape(-1, self.hidden_size), self.forwards, self.router.num_categories,
                           per_token(categories, shape, "categories"), per_token(token_ids, shape, "token_ids"), valid)
        tokens.copy_meta = tokens.categories
        tokens.row_tags = self._row_tags(x, padding_mask)
        tokens.layout = (tuple(shape[:-1]), padding_mask)
        return tokens

    def route(self, tokens: Tokens) -> Routing:
        """The strategy's routing, then capacity (drops), then any zero-ablation."""
        routing = tokens.route(self.router)
        routing.expert_idx, routing.gates = capacity_step(
            routing.expert_idx, routing.gates, self.num_experts, self.capacity_factor, routing.stats)
        if self.ablated_experts:  # the expert still runs; its gated output is zeroed (denominators unchanged)
            off = torch.isin(routing.expert_idx, torch.tensor(sorted(self.ablated_experts), device=tokens.h.device))
            routing.gates = torch.where(off, torch.zeros_like(routing.gates), routing.gates)
        return routing

    def _row_tags(self, x: Tensor, padding_mask: Tensor | None) -> Tensor | None:
        """Per-token tags the experts' capture asks for (GAR's source examples), or None."""
        capture = self.experts.capture
        if capture is None or capture.source_tags is None:
            return None
        return capture.source_tags(x.shape[:-1], padding_mask, x.device)

    @property
    def last_routing(self) -> Routing | None:
        """The Routing of the latest forward (this rank's tokens), detached."""
        return self.last_forward.routing


    def moe_view(self):
        """This layer's router, experts and last inputs (``dist_moe.moe.view.MoEView``)."""
        ep = self.dispatcher.exchanges
        return MoEView(self.router, {n: [p] for n, p in self.experts.template().items()}, True,
                       list(self.experts.parameters()), self.last_forward,
                       self.group if ep else None, self.dispatcher.rank if ep else 0, self.experts)

    @property
    def expert_node(self) -> Tensor | None:
        """[E] the node of each expert, on a topology of more than one node (else None)."""
        return expert_locations(self.placement, self.topology)[0]

    @property
    def expert_rank(self) -> Tensor | None:
        """[E] the rank of each expert, under expert parallelism (else None)."""
        return expert_locations(self.placement, self.topology)[1]

    def expert_state_keys(self, prefix: str = "") -> dict:
        """state-dict key of each expert tensor -> (global expert ids of its rows, checkpoint stem, stacked)."""
        return {f"{prefix}experts.{slot}": (self.local_expert_ids, f"{prefix}experts.{slot}", True)
                for slot, _ in self.experts.named_parameters()}

    @property
    def metadata_bytes(self) -> int:
        """Routing metadata (expert ids, gates, categories) this rank sent since the last reset."""
        return self.dispatcher.metadata_bytes


def _local_experts(world: int, rank: int, *args, **kwargs) -> Experts:
    """This rank's experts, drawn from a stream of its own under expert parallelism."""
    if world == 1:
        return Experts(*args, **kwargs)
    with per_rank_draw(rank):
        return Experts(*args, **kwargs)
