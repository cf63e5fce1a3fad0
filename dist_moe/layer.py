"""MoELayer = router + dispatcher + local experts (+ shared expert).

Its forward reads as its stages: tokens -> route (strategy, capacity) -> exchange (dispatch ->
experts -> combine, ``dispatch/exchange.py``, shared with the engines' layers) -> record. With ``group=None``
or a world of one, the dispatcher is local (``LocalDispatcher``: tokens grouped by
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

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dist_moe.dispatch.contract import Dispatcher
from dist_moe.dispatch.dispatcher import CountsTraffic, make_dispatcher
from dist_moe.dispatch.exchange import ExpertExchange
from dist_moe.dispatch.groups import WeakGroup
from dist_moe.dispatch.moe_forward import Tokens, tokens_in
from dist_moe.dispatch.pipeline import check_chunks
from dist_moe.dispatch.stages import stage
from dist_moe.experts import Experts, SharedExpert
from dist_moe.moe_view import MoEView, expert_locations
from dist_moe.routing import Router, Routing, build_router
from dist_moe.routing.capacity import capacity_for, capacity_step, check_one_capacity
from dist_moe.routing.registry import RouterConfig, router_config
from dist_moe.seeding import fork_rng
from placement import Placement, Topology
from placement.plan import check_dedup


class MoELayer(CountsTraffic, nn.Module):
    group = WeakGroup()  # held weakly: torch.distributed owns the group (dispatch/groups.py)

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        router: Router | RouterConfig | dict,
        placement=None,
        topology=None,
        group=None,
        dedup: str = "rank",
        capacity_factor: float | None = None,
        shared_expert_hidden: int = 0,
        expert_type: str = "swiglu",
        timeout=None,
        pipeline_chunks: int = 1,
        deterministic: bool = False,
        **expert_kwargs,
    ):
        """``timeout`` (timedelta) bounds the collectives of any process group this layer creates
        (node dedup's per-node groups); ``group``'s own timeout is set where it was created.
        ``pipeline_chunks`` C > 1 cuts each rank's tokens into C chunks whose exchanges are in
        flight while the experts run others (``dispatch/pipeline.py``); the same C on every rank.
        Without expert parallelism nothing is exchanged and C changes nothing.
        ``deterministic`` (``train.deterministic``) sums each token's expert outputs, and the
        gradient rows of its copies, in a fixed order instead of with index_add, whose atomics on
        a GPU add them in any order (``dispatch/combine.py``): a rerun repeats bit for bit. It
        costs an extra pass over the [T * K, H] rows."""
        super().__init__()
        check_dedup(dedup)
        self.pipeline_chunks = check_chunks(pipeline_chunks)
        if capacity_factor is not None:
            capacity_for(1, 1, 1, capacity_factor)  # validates the value
        world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        if isinstance(router, (dict, RouterConfig)):
            config = router_config(router, given_later=("hidden_size",))
            if config.hidden_size not in (None, hidden_size):
                raise ValueError(f"router hidden_size {config.hidden_size} != layer hidden_size {hidden_size}")
            router = build_router(config.given(hidden_size=hidden_size), stats_group=group if world > 1 else None)
        if not isinstance(router, Router):
            raise ValueError(f"router must be a Router or a config, got {type(router).__name__}")
        check_one_capacity(router, capacity_factor)
        e = router.num_experts
        # every check below happens before the first collective
        topology = topology if topology is not None else Topology.launched(world)
        if topology.world_size != world:
            raise ValueError(f"topology {topology.describe()} has {topology.world_size} ranks, the group {world}")
        placement = placement if placement is not None else Placement.contiguous(e, world)
        placement.check(e, world)
        self.hidden_size = hidden_size
        self.router = router
        self.num_experts = e
        self.placement, self.topology, self.group, self.dedup = placement, topology, group, dedup
        bind_to_topology(router, placement, topology)  # may raise: before the dispatcher creates any group
        rank = dist.get_rank(group) if world > 1 else 0
        self.local_expert_ids = placement.local_experts(rank)
        self.dispatcher: Dispatcher = make_dispatcher(group, placement, topology, dedup, timeout, deterministic)
        self.experts = _local_experts(world, rank, len(self.local_expert_ids), hidden_size, ffn_hidden_size,
                                      expert_type, **expert_kwargs)
        self.shared_expert = SharedExpert(hidden_size, shared_expert_hidden) if shared_expert_hidden else None
        self.capacity_factor = capacity_factor
        self.ablated_experts: frozenset = frozenset()  # zero-ablation for diagnostics (SpecDrop's Align)
        self.last_routing: Routing | None = None
        self.last_router_input: Tensor | None = None
        self.last_router_extras: dict = {}
        self.last_token_layout: tuple = ((), None)
        self.forwards = 0  # counted before anything can raise: the exchanges' tag (dispatch/agree.py)

    def forward(
        self,
        x: Tensor,
        categories: Tensor | None = None,
        token_ids: Tensor | None = None,
        padding_mask: Tensor | None = None,
    ):
        """x [..., hidden]; categories / token_ids per token (or [B] per sequence);
        padding_mask [B, S] bool, True at padding (routed like any token, left out of the
        router's statistics: aux loss, loads, anchors, biases; and of per-example summaries such
        as GAR's). Returns (y [..., hidden], the router's aux loss)."""
        self.forwards += 1
        tokens = self._tokens(x, categories, token_ids, padding_mask)
        exchange = ExpertExchange(self.dispatcher)
        with exchange.agreement(self.router):
            with stage("route"):
                routing = self._route(tokens)  # the strategy, capacity, ablation
            # dispatch -> experts -> combine, pipelined by chunk; the shared expert runs while chunks fly
            y, shared = exchange.run(tokens, routing, self.experts, chunks=self.pipeline_chunks,
                                     shared=self.shared_expert, copy_meta=tokens.categories,
                                     row_tags=self._row_tags(x, padding_mask))
        self._record(routing, tokens, x.shape, padding_mask)
        return (y if shared is None else y + shared).reshape(x.shape), routing.aux_loss

    def _tokens(self, x: Tensor, categories, token_ids, padding_mask) -> Tokens:
        """Checked and flattened: [T, H] tokens and per-token categories, token ids and validity."""
        shape = x.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(f"MoELayer input last dim {shape[-1]} != hidden_size {self.hidden_size}")
        if padding_mask is not None and padding_mask.shape != shape[:-1]:
            raise ValueError(f"padding_mask must have shape {tuple(shape[:-1])}, got {tuple(padding_mask.shape)}")
        valid = None if padding_mask is None else ~padding_mask.reshape(-1)  # padding stays out of statistics
        return tokens_in(x.reshape(-1, self.hidden_size), self.forwards, self.router,
                         per_token(categories, shape, "categories"), per_token(token_ids, shape, "token_ids"), valid)

    def _route(self, tokens: Tokens) -> Routing:
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

    def _record(self, routing: Routing, tokens: Tokens, shape, padding_mask) -> None:
        """What diagnostics and GAR's recomputation read after the forward."""
        self.last_routing = routing.detached()  # keeping the graph alive would pin activations
        self.last_router_input = tokens.h.detach()
        self.last_router_extras = tokens.extras
        self.last_token_layout = (tuple(shape[:-1]), padding_mask)

    def moe_view(self):
        """This layer's router, experts and last inputs (``dist_moe.moe_view.MoEView``)."""
        ep = self.dispatcher.exchanges
        return MoEView(self.router, {n: [p] for n, p in self.experts.template().items()}, True,
                       list(self.experts.parameters()),
                       lambda: (self.last_router_input, self.last_router_extras, self.last_token_layout),
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


def _local_experts(world: int, rank: int, *args, **kwargs) -> Experts:
    """This rank's experts. Under expert parallelism each rank draws them from its own stream
    (one global seed would give every rank the same experts) and leaves the global stream
    where it was, so the replicated modules built next stay identical across ranks."""
    if world == 1:
        return Experts(*args, **kwargs)
    with fork_rng():
        torch.manual_seed(torch.initial_seed() + 1 + rank)
        return Experts(*args, **kwargs)


def per_token(t: Tensor | None, shape, name: str) -> Tensor | None:
    """Flatten a per-token tensor; a [B] tensor for [B, S, H] inputs is repeated per position.
    (The engine-hosted layers use it too.)"""
    if t is None:
        return None
    lead = shape[:-1]
    if t.shape == lead:
        return t.reshape(-1)
    if len(lead) == 2 and t.shape == lead[:1]:
        return t.unsqueeze(1).expand(lead).reshape(-1)
    raise ValueError(f"{name} must have shape {tuple(lead)} (or [B] per sequence), got {tuple(t.shape)}")
