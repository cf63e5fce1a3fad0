"""Any dist-moe routing strategy inside DeepSpeed's MoE layer (written against 0.19.8).

``DistMoEGate`` implements the gate contract of ``deepspeed.moe.sharded_moe.MOELayer``:
``gate(tokens [S, M], used_token, sparse_routes, use_tutel)`` returns seven values,
``(l_aux, C, E, indices [K, S], locations [K, S], gates [K, S], exp_counts [E])``:
indices -1 for dropped routes, (expert, location) slots unique and below C, and C
the same on every expert-parallel rank (DeepSpeed sends E x C capacity-padded
slots per rank). The router gradient flows through ``gates``. ``l_aux`` follows
DeepSpeed's convention: unscaled (the strategy's ``aux_loss_coeff`` divided out), for
the training loop's ``loss + coeff * l_aux``; ``DeepSpeedHostedMoE`` applies the
strategy's coefficient itself, as dist-moe's layer does.

Placement: DeepSpeed keeps expert slot s on EP rank s // (E / ep). A dist-moe
placement is honoured by relabelling: logical expert e goes to the physical slot
(rank of e) * E/ep + (local index of e), so the experts DeepSpeed holds on rank r
are ``placement.local_experts(r)`` in order. The router, its aux loss and
``last_routing`` stay in logical expert ids.

SpecDrop categories and hash token ids reach the gate through
``dist_moe.integrations.context.routing_context`` (DeepSpeed passes the gate
nothing but tokens).

Capacity: with ``capacity_factor`` it is DeepSpeed's own rule (``sharded_moe._capacity``:
ceil(T / E * capacity_factor * k) in float32, at least ``min_capacity``, default 8 as
DeepSpeed's TopKGate's), with T the largest token count of any EP rank; dropless, the fullest
expert of any rank (at least ``min_capacity``). Where dist-moe's gate differs from
DeepSpeed's top2gating on purpose:

* a dropped slot: when one of a token's two slots overflows its expert, DeepSpeed
  renormalises the surviving gate to 1 (gates1 / (gates1 + gates2) after the drop);
  dist-moe keeps the survivor's pre-drop weight (GShard's convention), so a token
  that lost an expert is not scaled up;
* the aux loss: DeepSpeed's k=2 l_aux counts first choices only (``ce`` from mask1);
  dist-moe's strategies count every selected slot (Switch's f_e over T*K selections).
"""
from __future__ import annotations

import datetime
import math
import struct

import torch
from torch import Tensor, nn

import dist_moe.integrations.deepspeed.patches as deepspeed_patches
from dist_moe.dispatch.contract import Tokens
from dist_moe.dispatch.exchange import ExchangeConfig
from dist_moe.distributed.groups import WeakGroup
from dist_moe.distributed.process_group import shutdown
from dist_moe.integrations.context import context_tokens, routing_extras
from dist_moe.integrations.deepspeed.dispatch import per_expert, use_dist_moe_dispatcher
from dist_moe.integrations.hosted import call_engine
from dist_moe.moe.cluster import bind_to_topology
from dist_moe.moe.experts import SingleExpert
from dist_moe.moe.forward import LastForward, agreed_route
from dist_moe.moe.layer import MoELayerConfig
from dist_moe.moe.view import MoEView, expert_locations
from dist_moe.optional_engines import engine_import
from dist_moe.routing import Router
from dist_moe.routing.capacity import apply_capacity, capacity_for, check_one_capacity, slot_positions
from dist_moe.routing.registry import RouterConfig, layer_router
from dist_moe.seeding import per_rank_draw
from placement import Placement, Topology


def deepspeed_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float,
                       min_capacity: int = 8) -> int:
    """DeepSpeed 0.19.8's ``_capacity`` for a top-k gate, bit for bit: its float32 product, computed on
    the host (a tensor built and read back per forward would stall a GPU's stream)."""
    product = _f32(_f32(tokens / num_experts) * _f32(capacity_factor * top_k))  # exact: 2 x 24 bits fit a double
    return max(math.ceil(product), min_capacity)


def _f32(value: float) -> float:
    """``value`` rounded to float32, as torch stores a Python number it multiplies a float32 tensor by."""
    return struct.unpack("f", struct.pack("f", value))[0]


class DistMoEGate(nn.Module):
    ep_group = WeakGroup()  # DeepSpeed's EP group, held weakly (dist_moe/distributed/groups.py)

    def __init__(self, router: Router | dict, hidden_size: int, ep_size: int = 1, placement: Placement | None = None,
                 capacity_factor: float | None = None, min_capacity: int = 8, topology=None):
        """``topology`` (a ``placement.Topology`` of the EP ranks) tells a router that asks for it where
        the node boundary is (``node_limit``, ``subtree_limit`` by level)."""
        super().__init__()
        if isinstance(router, (dict, RouterConfig)):
            router = layer_router(router, hidden_size)
            self._owns_stats = True  # reduce its statistics over the EP group once DeepSpeed names it
        else:
            self._owns_stats = False
        e = router.num_experts
        if ep_size < 1 or e % ep_size:
            raise ValueError(f"DeepSpeed needs num_experts ({e}) divisible by ep_size ({ep_size})")
        placement = placement if placement is not None else Placement.contiguous(e, ep_size)
        placement.check(e, ep_size)
        if capacity_factor is not None:
            capacity_for(1, 1, 1, capacity_factor)  # validates
        check_one_capacity(router, capacity_factor)
        if isinstance(min_capacity, bool) or not isinstance(min_capacity, int) or min_capacity < 0:
            raise ValueError(f"min_capacity must be an int >= 0, got {min_capacity!r}")
        if topology is not None:
            bind_to_topology(router, placement, topology)
        self.router, self.placement, self.ep_size = router, placement, ep_size
        self.capacity_factor, self.min_capacity = capacity_factor, min_capacity
        self.register_buffer("physical_slot", placement.engine_slots(), persistent=False)
        self.ep_group = None
        self.forwards = 0  # the tag every EP rank agrees on (dist_moe/dispatch/agree.py)
        self.last_forward = LastForward()
        self.reset_traffic()

    def _set_ep_group(self, group) -> None:
        self.ep_group = group
        if self._owns_stats:  # every rank holds different tokens: the statistics are summed over all of them,
            dist = torch.distributed  # so the replicas of an EP group smaller than the world keep one router state
            whole = dist.get_world_size(group) == dist.get_world_size()
            self.router.stats_group = group if whole else dist.group.WORLD

    def reset_traffic(self) -> None:
        """Dispatch-direction bytes this rank sent: ``padded`` (what DeepSpeed's all-to-all
        moves, E x C slots) and ``payload`` (routed token copies for other ranks)."""
        self._padded, self._payload = 0, None  # payload: counted on the device, read when asked for

    @property
    def traffic(self) -> dict:
        payload = 0 if self._payload is None else int(self._payload)
        return {"padded_bytes": self._padded, "payload_bytes": payload}

    def _ep_rank(self) -> int:
        return 0 if self.ep_group is None or self.ep_size == 1 else torch.distributed.get_rank(self.ep_group)

    def forward(self, x: Tensor, used_token: Tensor | None = None, sparse_routes: bool = True,
                use_tutel: bool = False):
        if use_tutel or not sparse_routes:
            raise ValueError("DistMoEGate returns sparse routes only (use_tutel=False)")
        e = self.router.num_experts
        self.forwards += 1
        tokens = self.tokens(x, used_token, self.forwards)
        # bad input is agreed on by every EP rank (one all-reduce that also agrees on the capacity):
        # a rank that raised alone would pair its next batch with its peers' current one. Capped: DeepSpeed's
        # rule, from the largest token count; dropless: the fullest expert on any rank sets the (shared)
        # capacity, a host int DeepSpeed sizes its buffers with (one read)
        need = (lambda routing: (x.shape[0],)) if self.capacity_factor is not None else (
            lambda routing: (int(per_expert(routing.expert_idx, e).max()),))
        group = self.ep_group if self.ep_size > 1 else None
        routing, (agreed,) = agreed_route(tokens, self.route, self.router, group, "DistMoEGate", need)
        idx, gates = routing.expert_idx, routing.gates
        if self.capacity_factor is not None:
            capacity = deepspeed_capacity(agreed, idx.shape[1], e, self.capacity_factor, self.min_capacity)
            idx, gates, dropped = apply_capacity(idx, gates, e, capacity)
            routing.stats["dropped"] = dropped
        else:
            capacity = max(agreed, self.min_capacity, 1)
        routing.expert_idx, routing.gates = idx, gates
        routed = idx >= 0
        physical = torch.where(routed, self.physical_slot.to(idx.device)[idx.clamp_min(0)], -1)
        locations = torch.where(routed, slot_positions(idx, e), 0)
        exp_counts = per_expert(physical, e)
        self._count(physical, capacity, x)
        self.last_forward.keep(tokens, routing)
        return self.unscaled_aux(routing.aux_loss), capacity, e, physical.t(), locations.t(), gates.t(), exp_counts

    def tokens(self, x: Tensor, used_token: Tensor | None, tag: int) -> Tokens:
        """``x`` [S, M] with categories / token ids from ``routing_context`` and tokens whose
        ``used_token`` is 0 out of the router's statistics, tagged with their host's forward."""
        used = None if used_token is None else used_token.reshape(-1) > 0
        return context_tokens(x, routing_extras(x.shape[0]), used, tag, self.router.num_categories)

    def route(self, tokens: Tokens):
        """The strategy's routing (logical expert ids); unused tokens routed nowhere."""
        routing = tokens.route(self.router)
        if tokens.valid is not None:
            used = tokens.valid.unsqueeze(1)
            routing.expert_idx = torch.where(used, routing.expert_idx, -1)
            routing.gates = torch.where(used, routing.gates, torch.zeros_like(routing.gates))
        return routing

    @property
    def last_routing(self):
        return self.last_forward.routing

    def physical_counts(self, idx: Tensor) -> Tensor:
        """[E] routes per DeepSpeed physical slot (what its gates count) of logical ``idx`` (-1: dropped)."""
        physical = torch.where(idx >= 0, self.physical_slot.to(idx.device)[idx.clamp_min(0)], -1)
        return per_expert(physical, self.router.num_experts)

    def unscaled_aux(self, aux: Tensor) -> Tensor:
        """DeepSpeed's convention: a gate returns l_aux without its coefficient and the training loop
        writes ``loss + coeff * l_aux``. dist-moe's strategies scale theirs (``aux_loss_coeff``), so it
        is divided out here; the strategy's coefficient then only says whether there is one (0: none)."""
        coeff = self.router.aux_loss_coeff
        return aux / coeff if coeff else aux

    def _count(self, physical: Tensor, capacity: int, x: Tensor) -> None:
        row = x.shape[1] * x.element_size()
        per_rank = self.router.num_experts // self.ep_size
        remote = (physical >= 0) & (physical // per_rank != self._ep_rank())
        payload = remote.sum() * row
        self._payload = payload if self._payload is None else self._payload + payload
        self._padded += (self.ep_size - 1) * per_rank * capacity * row


def deepspeed_moe_layer(hidden_size: int, ffn_hidden_size: int | None, router: Router | dict, ep_size: int = 1,
                        placement: Placement | None = None, capacity_factor: float | None = None,
                        expert_type: str = "swiglu", *, expert: nn.Module | None = None, min_capacity: int = 8,
                        topology=None, dispatcher: str = "deepspeed", dedup: str = "rank", pipeline_chunks: int = 1,
                        timeout=None, exchange: ExchangeConfig | None = None, **expert_kwargs):
    """A ``deepspeed.moe.layer.MoE`` whose gate is ``DistMoEGate``. Its experts are dist-moe's
    (``expert_type``, ``ffn_hidden_size``), or, as ``deepspeed.moe.layer.MoE(expert=...)`` takes it,
    the user's own ``expert`` module, which DeepSpeed copies into every local slot.
    ``min_capacity`` defaults to 8, as DeepSpeed's ``TopKGate`` (its ``MoE`` passes 4: give
    ``min_capacity=4`` to match it). ``dispatcher="dist_moe"`` moves the tokens with dist-moe's
    dropless dispatcher (``dedup``, ``pipeline_chunks``; ``dispatch.py``) instead of DeepSpeed's
    capacity-padded all-to-all (``exchange``: an ``ExchangeConfig`` giving those settings at once instead).

    Call ``set_deepspeed_parallelism()`` (or let ``deepspeed.initialize`` do it) after
    ``deepspeed.init_distributed``; the layer returns (output, l_aux unscaled as DeepSpeed's gates
    return it, expert counts).
    """
    if dispatcher not in ("deepspeed", "dist_moe"):
        raise ValueError(f"dispatcher must be 'deepspeed' or 'dist_moe', got {dispatcher!r}")
    deepspeed_patches.apply()
    MoE = engine_import("deepspeed.moe.layer", "MoE")

    gate = DistMoEGate(router, hidden_size, ep_size, placement, capacity_factor, min_capacity, topology)
    if expert is None:
        if ffn_hidden_size is None:
            raise ValueError("deepspeed_moe_layer needs ffn_hidden_size for dist-moe's experts, or an expert module")
        expert = SingleExpert(hidden_size, ffn_hidden_size, expert_type, **expert_kwargs)
    elif not isinstance(expert, nn.Module):
        raise ValueError(f"expert must be a torch.nn.Module (DeepSpeed copies it per slot), "
                         f"got {type(expert).__name__}")
    # k=1 only satisfies MoE's own TopKGate check; that gate is replaced before any use
    moe = MoE(hidden_size, expert, num_experts=gate.router.num_experts, ep_size=ep_size, k=1)
    moe.deepspeed_moe.gate = gate
    if dispatcher == "dist_moe":
        use_dist_moe_dispatcher(moe, dedup, pipeline_chunks, topology, timeout, exchange)
    return moe


def init_distributed(timeout_s: float | None = None, device: torch.device | None = None) -> None:
    """``deepspeed.init_distributed`` on NCCL for a GPU ``device`` (set as the current device first),
    gloo with the CPU patches otherwise (default: a GPU when one is visible); ``timeout_s`` bounds
    every collective of the group (DeepSpeed's default: 30 min)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    deepspeed_patches.apply(cpu=device.type == "cpu")
    deepspeed = engine_import("deepspeed")

    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    deepspeed_patches.time_out_groups(timeout)  # the engine's own groups too, not only the world
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                               **({} if timeout is None else {"timeout": timeout}))


def shutdown_distributed() -> None:
    """The end of a job that ``init_distributed`` started: DeepSpeed's cached groups are dropped, then
    the group is left (``dist_moe.distributed.process_group.shutdown``), so none of them outlives it and
    aborts the process at exit (dist_moe/distributed/groups.py)."""
    deepspeed_patches.release_groups()
    shutdown()


class DeepSpeedHostedMoE(nn.Module):
    """dist-moe's layer interface over a DeepSpeed-hosted MoE: ``(y, aux) = layer(x, categories, token_ids,
    padding_mask)``, built from an ``MoELayerConfig``. ``dispatcher``: DeepSpeed's capacity-padded
    all-to-all (``deepspeed``; the config's exchange settings unused) or dist-moe's (``dist_moe``, as the
    config's ``exchange`` says: the layer then measures its bytes, ``dispatched.traffic``, as dist-moe's
    own MoELayer does).

    Needs ``deepspeed.init_distributed`` (``init_distributed`` here) first when ``ep_size > 1``.
    """

    def __init__(self, config: MoELayerConfig, ep_size: int = 1, placement: Placement | None = None,
                 topology: Topology | None = None, *, expert: nn.Module | None = None, min_capacity: int = 8,
                 dispatcher: str = "deepspeed"):
        super().__init__()
        self.hidden_size = hidden_size = config.hidden_size
        exchange = config.exchange
        self.moe = deepspeed_moe_layer(hidden_size, config.ffn_hidden_size, config.router, ep_size, placement,
                                       config.capacity_factor, config.expert_type, expert=expert,
                                       min_capacity=min_capacity, topology=topology, dispatcher=dispatcher,
                                       exchange=exchange, **config.expert_options)
        self.dispatcher_kind = dispatcher
        self.expert_node, self.expert_rank = expert_locations(self.gate.placement, topology)
        rank = 0
        if torch.distributed.is_initialized():
            self.moe.set_deepspeed_parallelism()
            rank = torch.distributed.get_rank()
        if expert is None:
            # DeepSpeed deep-copies one expert module into every slot of every rank: each of dist-moe's
            # experts gets its own draw. A user's own expert module keeps DeepSpeed's behaviour: identical copies.
            with per_rank_draw(rank):
                for copy in self._local():
                    copy.load_state_dict(SingleExpert(hidden_size, config.ffn_hidden_size, config.expert_type,
                                                      **config.expert_options).state_dict())

    def forward(self, x: Tensor, categories: Tensor | None = None, token_ids: Tensor | None = None,
                padding_mask: Tensor | None = None):
        return call_engine(self._run, x, categories, token_ids, padding_mask)

    def _run(self, tokens: Tensor, padding: Tensor | None) -> tuple[Tensor, Tensor]:
        y, l_aux, _ = self.moe(tokens, used_token=None if padding is None else (~padding).float())
        # dist-moe's layer interface returns the aux loss with the strategy's coefficient applied
        return y, l_aux * self.router.aux_loss_coeff

    @property
    def dispatched(self):
        """DeepSpeed's MOELayer when dist-moe's dispatcher moves its tokens (it counts their bytes), else None."""
        return self.moe.deepspeed_moe if self.dispatcher_kind == "dist_moe" else None

    def _local(self) -> list:
        return list(self.moe.deepspeed_moe.experts.deepspeed_experts)

    def expert_state_keys(self, prefix: str = "") -> dict:
        """Each local expert copy's tensors under dist-moe's checkpoint stems (``experts.<slot>``)."""
        ids = self.gate.placement.local_experts(self.gate._ep_rank())
        out = {}
        for j, copy in enumerate(self._local()):
            inner = "inner." if isinstance(copy, SingleExpert) else ""
            for slot in expert_slots(copy):
                out[f"{prefix}moe.deepspeed_moe.experts.deepspeed_experts.{j}.{inner}{slot}"] = (
                    [ids[j]], f"{prefix}experts.{slot}", isinstance(copy, SingleExpert))
        return out

    @property
    def gate(self) -> DistMoEGate:
        return self.moe.deepspeed_moe.gate

    @property
    def router(self) -> Router:
        return self.gate.router

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    @property
    def last_routing(self):
        return self.gate.last_forward.routing

    def moe_view(self):
        """DeepSpeed's expert copies as one template (GAR: materialized observations from their gradients)."""
        local = self._local()
        slots = [expert_slots(e) for e in local]
        template = {n: [s[n] for s in slots] for n in slots[0]}
        gate = self.gate
        ep = gate.ep_group if gate.ep_size > 1 else None
        return MoEView(self.router, template, isinstance(local[0], SingleExpert),
                       [p for e in local for p in e.parameters()], gate.last_forward, ep, gate._ep_rank())


def expert_slots(expert: nn.Module) -> dict:
    """An expert copy's trainable parameters by template slot: dist-moe's ``SingleExpert`` by its
    slot names (each a stacked [1, ...] tensor), a user's module by its own parameter names."""
    if isinstance(expert, SingleExpert):
        return expert.inner.template()
    return {n: p for n, p in expert.named_parameters() if p.requires_grad}


def load_dist_moe_experts(moe, experts) -> None:
    """Copy this rank's dist-moe ``Experts`` (same local order) into DeepSpeed's expert slots."""
    local = moe.deepspeed_moe.experts.deepspeed_experts
    if len(local) != experts.num_experts:
        raise ValueError(f"DeepSpeed holds {len(local)} local experts, the dist-moe Experts {experts.num_experts}")
    with torch.no_grad():
        for j, expert in enumerate(local):
            for name, p in expert.inner.named_parameters():
                p.copy_(getattr(experts, name)[j : j + 1])
