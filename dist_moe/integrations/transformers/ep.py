"""dist-moe's dispatcher inside Hugging Face transformers' expert parallelism (written against
transformers 5.25).

The one line a transformers user adds, before loading the model:

    import dist_moe.integrations.transformers as dm_hf
    dm_hf.use(dedup="node", pipeline_chunks=2)
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(
        ep_size=world, fsdp_size=world, ep_implementation="dist_moe"))

transformers shards every MoE layer's stacked experts over its expert-parallel mesh (rank r holds
experts [r E/W, (r+1) E/W): dist-moe's contiguous placement) and hands an ``EPImplementation`` this
rank's tokens with the top-k expert ids and weights the model's own router chose. ``DistMoEEP``
sends them through dist-moe's dispatcher instead of transformers' ``all_to_all``: one copy per
destination rank (``rank``) or node (``node``), pipelined in chunks, bytes counted per topology
level; the model's experts run on what arrives (their stacked ``gate_up_proj`` / ``down_proj`` as two
grouped GEMMs where the layout is the plain one, else the experts' own forward), and the weighted
outputs come back summed per token. The router, the experts' weights, FSDP and the checkpoint
layout stay transformers'. Every model loaded after ``use`` keeps the settings it was loaded with.
"""
from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from dist_moe.dispatch.apply_experts import compute_dtype
from dist_moe.dispatch.exchange import ExchangeConfig
from dist_moe.dispatch.weight_casts import cast_weight
from dist_moe.integrations.stacked import grouped_mm
from dist_moe.moe.chosen import ChosenRouter, chosen_route, chosen_tokens
from dist_moe.moe.experts import grouped_ok, offsets
from dist_moe.moe.forward import OfExchange, moe_forward
from dist_moe.optional_engines import engine_import
from placement import Placement, Topology, Traffic
from placement.ep_groups import group_topology

NAME = "dist_moe"  # the ep_implementation a DistributedConfig names


@dataclass(frozen=True)
class Settings:
    exchange: ExchangeConfig = ExchangeConfig()
    topology: Topology | None = None  # None: the launcher's (torchrun's variables, DIST_MOE_TOPOLOGY)
    placement: object = None  # None, "contiguous", "tree_prefix", a Placement or a `dist-moe place` file


_settings = Settings()


def use(dedup: str = "rank", pipeline_chunks: int = 1, topology: Topology | None = None, placement=None,
        timeout=None, exchange: ExchangeConfig | None = None) -> None:
    """Register the ``"dist_moe"`` EP implementation with these settings; models loaded afterwards with
    ``DistributedConfig(..., ep_implementation="dist_moe")`` exchange their tokens through dist-moe.
    ``timeout`` (a timedelta) bounds node dedup's per-node collectives (None: torch's default);
    ``exchange``: an ``ExchangeConfig`` giving dedup, pipeline_chunks and timeout at once instead."""
    global _settings
    if topology is not None and not isinstance(topology, Topology):
        raise ValueError(f"topology must be a placement.Topology or None, got {type(topology).__name__}")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise ValueError(f"timeout must be a datetime.timedelta or None, got {type(timeout).__name__}")
    exchange = exchange or ExchangeConfig(dedup, pipeline_chunks, timeout=timeout)  # checks them
    if not (placement is None or isinstance(placement, (str, Placement)) or hasattr(placement, "__fspath__")):
        raise ValueError(f"placement must be None, 'contiguous', 'tree_prefix', a Placement or a placement file, "
                         f"got {type(placement).__name__}")
    _settings = Settings(exchange, topology, placement)
    EPImplementationInterface = engine_import("transformers.distributed.expert_parallel", "EPImplementationInterface")

    EPImplementationInterface.register(NAME, implementation_class())


def traffic(model: torch.nn.Module) -> dict[str, int]:
    """{topology level: bytes} this rank sent in forward dispatch, summed over the model's MoE layers
    since it was loaded or since ``reset_traffic(model)``."""
    layers = _layers(model)
    total = sum(layer.dispatcher.traffic for layer in layers)
    return Traffic(total, layers[0].topology).by_level()


def reset_traffic(model: torch.nn.Module) -> None:
    for layer in _layers(model):
        layer.dispatcher.reset_traffic()


def _layers(model) -> list:
    layers = [m._dist_moe_ep for m in model.modules() if hasattr(m, "_dist_moe_ep")]
    if not layers:
        raise ValueError("the model has no MoE layer running through dist-moe: load it with "
                         "DistributedConfig(ep_size=..., ep_implementation='dist_moe') after "
                         "dist_moe.integrations.transformers.use()")
    return layers


def contiguous_placement(choice, num_experts: int, topology: Topology) -> Placement:
    """transformers' own layout (``Shard(0)``: rank r holds a contiguous block), which ``choice`` must
    equal: transformers loads each rank's experts by that layout, so another would need them moved."""
    layout = Placement.contiguous(num_experts, topology.world_size)
    if choice is None or choice == "contiguous":
        return layout
    if choice == "tree_prefix":
        wanted, what = Placement.tree_prefix(num_experts, topology), "tree-prefix placement"
    elif isinstance(choice, Placement):
        wanted, what = choice, "the given placement"
    else:
        wanted, what = Placement.from_yaml(choice), f"placement file {choice}"
    if wanted.world_size != layout.world_size or wanted.num_experts != num_experts:
        raise ValueError(f"{what} places {wanted.num_experts} experts on {wanted.world_size} ranks; the model "
                         f"has {num_experts} on {layout.world_size}")
    moved = [e for e in range(num_experts) if wanted.expert_to_rank[e] != layout.expert_to_rank[e]]
    if moved:
        e = moved[0]
        raise ValueError(f"{what} puts expert {e} on rank {wanted.expert_to_rank[e]}, but transformers loads it on "
                         f"rank {layout.expert_to_rank[e]} (experts in contiguous blocks); dist-moe does not move "
                         f"transformers' experts at load: use the contiguous placement")
    return layout


class StackedExperts:
    """A transformers experts module (stacked ``gate_up_proj`` [E, 2F, H] / ``down_proj`` [E, H, F],
    ``@use_experts_implementation``) behind the contract dist-moe's dispatcher runs experts through:
    rows grouped by local expert and their counts -> outputs, ``template()``, ``capture``.

    Their layouts (a gate or not, biases or not, transposed or not; the gate's halves concatenated or
    interleaved, which the module's own ``_apply_gate`` reads) run as two grouped GEMMs with
    ``_apply_gate`` / ``act_fn`` between them, as transformers' ``grouped_mm`` experts do; a norm after
    the experts, or weights the kernels refuse, through the module's own forward, every row top-1
    with weight 1 (the dispatcher gates the outputs)."""

    capture = None  # GAR's factor capture is dist-moe's experts' own

    def __init__(self, module, forward):
        self.module, self.forward = module, forward
        self.num_experts = module.num_experts  # this rank's: transformers sets it when it shards them

    def template(self) -> dict:
        # inside transformers' EP forward the parameters are their local shards
        return dict(self.module.named_parameters())

    def grouped(self, x: Tensor) -> bool:
        return True  # counts on the device either way: the fallback expands them there too

    def __call__(self, x: Tensor, counts: Tensor, tags: Tensor | None = None) -> Tensor:
        m = self.module
        weights = self._weights()
        dtype = compute_dtype(x)
        if weights is not None and grouped_ok(x, list(weights), dtype):
            x, (up, down) = x.to(dtype), (cast_weight(w, dtype) for w in weights)
            offs = offsets(counts)
            rows = None
            h = grouped_mm(x, up, offs)
            if m.has_bias:
                rows = self._rows(counts, x)
                h = h + (m.gate_up_proj_bias if m.has_gate else m.up_proj_bias)[rows].to(h.dtype)
            h = m._apply_gate(h) if m.has_gate else m.act_fn(h)
            out = grouped_mm(h, down, offs)
            return out + m.down_proj_bias[rows].to(out.dtype) if m.has_bias else out
        ids = self._rows(counts, x).unsqueeze(1)
        return self.forward(x, ids, x.new_ones(x.shape[0], 1))

    def _weights(self) -> tuple[Tensor, Tensor] | None:
        """(up [E, H, 2F], down [E, F, H]) as views in grouped_mm's [in, out] layout, or None."""
        m = self.module
        if getattr(m, "has_post_expert_norm", False) or not hasattr(m, "down_proj"):
            return None
        up = m.gate_up_proj if m.has_gate else getattr(m, "up_proj", None)
        if up is None or up.dim() != 3 or m.down_proj.dim() != 3:
            return None
        if m.is_transposed:
            return up, m.down_proj
        return up.transpose(1, 2), m.down_proj.transpose(1, 2)

    def _rows(self, counts: Tensor, x: Tensor) -> Tensor:
        """Each row's local expert id, from the counts on the device (no host read)."""
        return torch.repeat_interleave(torch.arange(counts.shape[0], device=x.device), counts,
                                       output_size=x.shape[0])


@functools.cache
def implementation_class():
    """``DistMoEEP``, transformers' ``EPImplementation`` subclass (built on first use)."""
    EPImplementation = engine_import("transformers.distributed.expert_parallel", "EPImplementation")

    class DistMoEEP(EPImplementation):
        """transformers' plug-in point for how tokens reach the experts, filled with dist-moe's dispatcher."""

        dispatcher = OfExchange("dispatcher")
        pipeline_chunks = OfExchange("chunks")

        def __init__(self, experts, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            if tp_mesh.size() > 1:
                raise ValueError(f"ep_implementation='{NAME}' needs tp_size=1 (got {tp_mesh.size()}): dist-moe's "
                                 f"dispatcher takes each rank's own tokens, not a tensor-parallel group's shared batch")
            settings = _settings
            world = ep_mesh.size()
            # an expert-parallel mesh smaller than the world (ep_size < the world, with fsdp replicas) sees the
            # launch's topology over its own ranks: its nodes and its ranks per node
            ranks = torch.distributed.get_process_group_ranks(ep_mesh.get_group())
            self.topology = settings.topology if settings.topology is not None else group_topology(
                Topology.launched(torch.distributed.get_world_size()), ranks)
            self.topology.check_ranks(world, "the expert-parallel mesh")
            self.num_experts = self.num_local_experts * world
            self.placement = contiguous_placement(settings.placement, self.num_experts, self.topology)
            self.dedup = settings.exchange.dedup
            self.exchange = settings.exchange.build(ep_mesh.get_group(), self.placement, self.topology)
            self.router = ChosenRouter(type(experts).__name__, self.num_experts)
            self.routed_experts = StackedExperts(experts, self.experts_forward)
            self.forwards = 0  # the exchanges' tag (dist_moe/dispatch/agree.py)
            experts._dist_moe_ep = self  # where traffic(model) finds it

        def __call__(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
            self.forwards += 1
            tokens = chosen_tokens(hidden_states, top_k_index, top_k_weights, self.forwards)
            y, _ = moe_forward(tokens, chosen_route, self.router, self.exchange, self.routed_experts)
            return y

    return DistMoEEP
