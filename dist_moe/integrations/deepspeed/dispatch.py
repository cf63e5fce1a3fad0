"""dist-moe's dispatcher inside DeepSpeed's MoE layer (written against deepspeed 0.19.8).

``deepspeed_moe_layer(..., dispatcher="dist_moe", dedup="node", pipeline_chunks=4)``, or for a
``deepspeed.moe.layer.MoE`` a user built: ``use_dist_moe_dispatcher(moe, dedup=..., ...)`` after
giving it a ``DistMoEGate``. DeepSpeed's ``MoE`` module, its expert copies (the user's expert
module), their ``allreduce=False`` / group-name marks for ZeRO and its expert-parallel groups
stay DeepSpeed's; only ``moe.deepspeed_moe`` (the ``MOELayer`` that pads every expert to one
capacity and exchanges E x C slots) becomes a ``MOELayer`` whose tokens travel through dist-moe's
dropless dispatcher: each token once per destination rank (or node), pipelined in chunks, bytes
measured per topology level. ``(output, l_aux, exp_counts)`` come back as before, l_aux
unscaled (DeepSpeed's convention). The dispatcher is made when DeepSpeed names the
expert-parallel group (``set_deepspeed_parallelism`` / ``deepspeed.initialize``).
"""
from __future__ import annotations

import functools
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

import dist_moe.integrations.deepspeed.patches as deepspeed_patches
from dist_moe.dispatch.apply_experts import compute_dtype
from dist_moe.dispatch.contract import Tokens
from dist_moe.dispatch.exchange import ExchangeConfig, ExpertExchange
from dist_moe.dispatch.weight_casts import cast_weight
from dist_moe.integrations.stacked import grouped_mm, stack_in_place, stacked_alias, stacked_view
from dist_moe.moe.cluster import bind_to_topology
from dist_moe.moe.experts import SingleExpert, grouped_ok, offsets
from dist_moe.moe.forward import ExchangeTraffic, LastForward, OfExchange, moe_forward
from dist_moe.optional_engines import engine_import
from dist_moe.routing import Routing
from placement import Topology


@runtime_checkable
class TokenGate(Protocol):
    """What the dispatched ``MOELayer`` asks of its gate: ``DistMoEGate``'s (``layer.py``) routing steps."""

    capacity_factor: float | None
    last_forward: LastForward

    def tokens(self, x: Tensor, used_token: Tensor | None, tag: int) -> Tokens: ...

    def route(self, tokens: Tokens) -> Routing: ...

    def unscaled_aux(self, aux: Tensor) -> Tensor: ...

    def physical_counts(self, idx: Tensor) -> Tensor: ...


class DeepSpeedExperts:
    """DeepSpeed's expert copies behind the contract dist-moe's dispatcher runs experts through
    (rows grouped by local expert, rows per expert -> outputs; ``template()``; ``capture``).

    Copies of dist-moe's own SwiGLU or GELU expert (``SingleExpert``) run as one grouped GEMM per
    projection over all local experts: their weights are laid out stacked once, in place, and seen
    as one [E, ...] tensor (``stacked.py``; DeepSpeed's flat optimizer buffers keep that layout:
    they place each group's parameters in order, one expert after the other). A user's own expert
    module is a black box, run copy by copy; so are LoRA copies (each holds its own frozen base),
    and weights re-homed apart or of a width or dtype the kernels refuse (``stacked.grouped_ok``)."""

    capture = None

    def __init__(self, experts):
        self.experts = experts  # deepspeed.moe.experts.Experts
        copies = list(experts.deepspeed_experts)
        self.num_experts = len(copies)
        kinds = {c.inner.kind if isinstance(c, SingleExpert) else None for c in copies}
        self._inner = [c.inner for c in copies] if kinds in ({"swiglu"}, {"gelu"}) else []
        self.restack()

    def template(self) -> dict:
        return {n: p for n, p in self.experts.named_parameters() if p.requires_grad}

    def _slots(self) -> list[str]:
        return list(self._inner[0].template()) if self._inner else []

    def restack(self) -> None:
        """Lay each slot's weights out stacked (again, after a conversion placed them apart)."""
        for name in self._slots():
            stack_in_place([getattr(e, name) for e in self._inner])

    def grouped(self, x: Tensor) -> bool:
        if not self._inner or self._inner[0].capture is not None:
            return False
        views = [stacked_alias([getattr(e, name) for e in self._inner]) for name in self._slots()]
        return all(v is not None for v in views) and grouped_ok(x, [v.squeeze(1) for v in views], compute_dtype(x))

    def __call__(self, x: Tensor, counts: list[int] | Tensor, tags: Tensor | None = None) -> Tensor:
        if torch.is_tensor(counts):  # grouped: SingleExpert's math over [E, in, out] stacked weights
            dtype = compute_dtype(x)  # autocast's, which F.grouped_mm does not apply itself; else x's
            x = x.to(dtype)
            w = {name: cast_weight(stacked_view([getattr(e, name) for e in self._inner]).squeeze(1), dtype)
                 for name in self._slots()}
            offs = offsets(counts.to(x.device))
            if "w_gate" in w:
                h = F.silu(grouped_mm(x, w["w_gate"], offs)) * grouped_mm(x, w["w_up"], offs)
                return grouped_mm(h, w["w_down"], offs)
            return grouped_mm(F.gelu(grouped_mm(x, w["w_fc1"], offs)), w["w_fc2"], offs)
        outs = []
        for expert, rows in zip(self.experts.deepspeed_experts, torch.split(x, counts)):
            out = expert(rows)
            outs.append(out[0] if isinstance(out, tuple) else out)  # DeepSpeed ignores a bias term too
        return torch.cat(outs)


def per_expert(idx: Tensor, num_experts: int) -> Tensor:
    """[E] routes per expert of ``idx`` (-1: dropped, not counted), counted on the device (bincount
    of the routed entries would size its output, and select them, by a host read)."""
    flat = idx.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=idx.device).scatter_add_(
        0, flat.clamp_min(0), (flat >= 0).long())


@functools.cache
def layer_class():
    """``DistMoEDispatchedMOELayer``: DeepSpeed's MOELayer with dist-moe's dispatcher (built on first use)."""
    deepspeed_patches.apply()
    MOELayer = engine_import("deepspeed.moe.sharded_moe", "MOELayer")

    class DistMoEDispatchedMOELayer(MOELayer):
        """DeepSpeed's MOELayer whose tokens travel through dist-moe's dispatcher, routed by its gate
        (``DistMoEGate.tokens`` / ``route``)."""

        pipeline_chunks = OfExchange("chunks")
        traffic, reset_traffic = ExchangeTraffic(), OfExchange("reset_traffic")

        def configure(self, exchange: ExchangeConfig, topology: Topology | None) -> None:
            self.exchange_config, self.dedup = exchange, exchange.dedup
            self.topology_given = topology
            self.topology = topology if topology is not None else Topology.flat(self.ep_size)
            self.placement = self.gate.placement
            # one EP rank: every expert is here; more: its dispatcher once DeepSpeed names the group
            local = self.ep_size == 1
            self.exchange = (exchange.build(None, self.placement, self.topology, what="DistMoEGate") if local
                             else ExpertExchange(None, exchange.pipeline_chunks, what="DistMoEGate"))
            self.routed_experts = DeepSpeedExperts(self.experts)
            self.forwards = 0  # the exchanges' tag (dist_moe/dispatch/agree.py)

        def _set_ep_group(self, ep_group) -> None:
            super()._set_ep_group(ep_group)
            if self.ep_size > 1:
                if self.topology_given is None:
                    self.topology = Topology.launched(self.ep_size)
                chunks = self.exchange.chunks  # what chunk tuning may have set already
                self.exchange = self.exchange_config.build(ep_group, self.placement, self.topology, what="DistMoEGate")
                self.exchange.chunks = chunks

        def forward(self, *input: Tensor, **kwargs) -> Tensor:
            x, used_token = input[0], (input[1] if len(input) > 1 else None)
            if self.exchange.dispatcher is None:
                raise ValueError("the dist_moe dispatcher has no expert-parallel group yet: call "
                                 "set_deepspeed_parallelism() (deepspeed.initialize does)")
            self.forwards += 1
            gate = self.gate  # a DistMoEGate
            tokens = gate.tokens(x.reshape(-1, x.shape[-1]), used_token, self.forwards)
            y, routing = moe_forward(tokens, gate.route, gate.router, self.exchange, self.routed_experts)
            gate.last_forward.keep(tokens, routing)
            # what DeepSpeed's MOELayer leaves for its MoE module: l_aux unscaled, counts by physical slot
            self.l_aux = gate.unscaled_aux(routing.aux_loss)
            self.exp_counts = gate.physical_counts(routing.expert_idx)
            return y.reshape(x.shape)

        def _apply(self, fn, *args, **kwargs):
            out = super()._apply(fn, *args, **kwargs)
            self.routed_experts.restack()  # .to() and .bfloat16() give every parameter a storage of its own
            return out

    return DistMoEDispatchedMOELayer


def use_dist_moe_dispatcher(moe, dedup: str = "rank", pipeline_chunks: int = 1, topology: Topology | None = None,
                            timeout=None, exchange: ExchangeConfig | None = None):
    """Let a ``deepspeed.moe.layer.MoE`` whose gate is a ``DistMoEGate`` exchange through dist-moe's
    dispatcher (before or after ``set_deepspeed_parallelism()`` / ``deepspeed.initialize``). ``topology``:
    the EP ranks' (None: the launch's); ``timeout`` (a timedelta) bounds node dedup's groups; ``exchange``
    gives all of these settings at once instead (an ``ExchangeConfig``). Returns ``moe``."""
    if exchange is None:
        exchange = ExchangeConfig(dedup, pipeline_chunks, timeout=timeout)
    old = moe.deepspeed_moe
    if not isinstance(old.gate, TokenGate):
        raise ValueError(f"the dist_moe dispatcher routes with a DistMoEGate, got {type(old.gate).__name__}")
    if old.gate.capacity_factor is not None:
        raise ValueError(f"capacity_factor={old.gate.capacity_factor}: the dist_moe dispatcher is dropless; "
                         "set it to None")
    if topology is not None:  # the node boundary for node_limit / subtree_limit routers

        bind_to_topology(old.gate.router, old.gate.placement, topology)
    layer = layer_class()(old.gate, old.experts, old.ep_group_name, old.ep_size, old.num_local_experts)
    layer.configure(exchange, topology)
    if old.ep_group is not None:  # DeepSpeed named the group already
        layer._set_ep_group(old.ep_group)
    moe.deepspeed_moe = layer
    return moe
