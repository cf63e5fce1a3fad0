"""dist-moe's dispatcher inside Megatron-core's MoE layer (written against megatron-core 0.16.1).

The one line a GPTModel user changes:

    spec.submodules.mlp = dist_moe_mlp_spec(router={"type": "branch", ...}, dedup="node",
                                            base=spec.submodules.mlp)

The layer is Megatron's ``MoELayer``: its experts (``SequentialMLP``; ``GroupedMLP`` /
``TEGroupedMLP`` where installed), shared experts, aux-loss tracker, ``sharded_state_dict`` and
``moe_*`` config fields stay Megatron's. The router is a ``DistMoERouter`` at ``mlp.router`` and the
experts stay at ``mlp.experts``, so the state-dict keys are those of the router swap
(``hosts.py``, ``router.py``) and a checkpoint moves between the two. Only the tokens move another way:
dist-moe's expert-parallel dispatcher (rank or node dedup, pipelined chunks, bytes measured per
topology level) in place of Megatron's token dispatcher. Megatron's experts scale by the gate
inside (``per_token_scale``); here they run with a scale of 1 and the dispatcher gates their
outputs, which is the same sum as long as the experts' last linear has no bias (Megatron refuses
``mlp_bias`` with its own dispatchers too).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

import dist_moe.integrations.megatron.patches as megatron_patches
from dist_moe.dispatch.apply_experts import compute_dtype
from dist_moe.dispatch.exchange import ExchangeConfig
from dist_moe.dispatch.weight_casts import cast_weight
from dist_moe.integrations.megatron.router import DistMoERouter
from dist_moe.integrations.stacked import grouped_mm, stack_in_place, stacked_alias, stacked_view
from dist_moe.moe.cluster import bind_to_topology
from dist_moe.moe.experts import grouped_ok, offsets
from dist_moe.moe.forward import ExchangeTraffic, OfExchange, moe_forward
from dist_moe.optional_engines import engine_import
from dist_moe.routing.registry import RouterConfig
from placement import Placement, Topology


class MegatronExperts:
    """Megatron's expert module behind the contract dist-moe's dispatcher runs experts through:
    ``experts(rows grouped by local expert, rows per expert, tags) -> outputs``, ``template()``
    (the trainable tensors the dispatch's backward returns gradients for) and ``capture``.

    SequentialMLP's experts run as two grouped GEMMs over all local experts (``F.grouped_mm`` on a
    stacked view of their fc1 and fc2 weights, ``stacked.py``; counts on the device), the math of
    Megatron's MLP: fc1, its GLU (gate half first) or activation, fc2. Its per-expert loop runs where
    a grouped GEMM cannot: weights that no longer lie at one stride (re-homed apart, e.g. by a
    gradient buffer that orders parameters its own way), a width or dtype the kernels refuse
    (``stacked.grouped_ok``), or an MLP whose activation this does not reproduce (Transformer
    Engine's activation, clamped or offset GLUs, fp8 / fp4 padding)."""

    capture = None  # GAR's factor capture is dist-moe's experts' own

    def __init__(self, experts):
        self.experts = experts
        self.num_experts = experts.num_local_experts
        local = getattr(experts, "local_experts", None)
        config = experts.config
        self._mlps = list(local) if local is not None and _plain_mlp(config) else []
        self.restack()

    def template(self) -> dict:
        return dict(self.experts.named_parameters())

    def _stacked(self) -> tuple[Tensor, Tensor] | None:
        """fc1 [E, H, F(x2)] and fc2 [E, F, H] as views of Megatron's weights, or None."""
        if not self._mlps:
            return None
        fc1 = stacked_view([m.linear_fc1.weight for m in self._mlps])
        fc2 = stacked_view([m.linear_fc2.weight for m in self._mlps])
        return None if fc1 is None or fc2 is None else (fc1.transpose(1, 2), fc2.transpose(1, 2))

    def grouped(self, x: Tensor) -> bool:
        if not self._mlps:
            return False
        fc1 = stacked_alias([m.linear_fc1.weight for m in self._mlps])
        fc2 = stacked_alias([m.linear_fc2.weight for m in self._mlps])
        return (fc1 is not None and fc2 is not None and fc1.shape[2] == x.shape[1]
                and grouped_ok(x, [fc1.transpose(1, 2), fc2.transpose(1, 2)], compute_dtype(x)))

    def restack(self) -> None:
        """Lay the weights out stacked again after a conversion placed them apart (``module.to``,
        ``bfloat16()``: torch gives every parameter a storage of its own)."""
        for slot in ("linear_fc1", "linear_fc2"):
            stack_in_place([getattr(m, slot).weight for m in self._mlps])

    def __call__(self, x: Tensor, counts: list[int] | Tensor, tags: Tensor | None = None) -> Tensor:
        weights = self._stacked() if torch.is_tensor(counts) else None
        if weights is not None:
            # autocast's dtype (train.precision bf16), which F.grouped_mm does not apply itself: the
            # GEMMs in bf16, as Megatron's linear layers run them under autocast or Float16Module
            dtype = compute_dtype(x)
            x, (fc1, fc2) = x.to(dtype), (cast_weight(w, dtype) for w in weights)
            offs = offsets(counts.to(x.device))
            h = grouped_mm(x, fc1, offs)
            if self.experts.config.gated_linear_unit:  # Megatron's glu: activation(first half) * second half
                gate, up = torch.chunk(h, 2, dim=-1)
                h = self.experts.config.activation_func(gate) * up
            else:
                h = self.experts.config.activation_func(h)
            return grouped_mm(h, fc2, offs)
        counts = counts.tolist() if torch.is_tensor(counts) else counts
        per_expert = torch.tensor(counts, dtype=torch.long)  # Megatron's tokens_per_expert, a host tensor
        out, bias = self.experts(x, per_expert, x.new_ones(x.shape[0], dtype=torch.float32))
        if bias is not None:
            raise ValueError("Megatron experts with a bias (add_bias_linear) are not gated linearly; "
                             "set add_bias_linear=False")
        return out


def _plain_mlp(config) -> bool:
    """Whether Megatron's MLP computes fc2(activation(fc1(x))) with no more than this adapter repeats
    (no bias, torch's SiLU or GELU, no Transformer Engine activation, clamp, offset or fp8 / fp4)."""
    return (not config.add_bias_linear and config.activation_func in (torch.nn.functional.silu,
                                                                       torch.nn.functional.gelu)
            and not getattr(config, "use_te_activation_func", False)
            and getattr(config, "activation_func_clamp_value", None) is None
            and not getattr(config, "glu_linear_offset", 0.0)
            and not getattr(config, "fp8", None) and not getattr(config, "fp4", None))


@functools.cache
def layer_class():
    """``DistMoEMoELayer``: Megatron's MoELayer with dist-moe's dispatcher (built on first use)."""
    megatron_patches.apply()
    MoELayer = engine_import("megatron.core.transformer.moe.moe_layer", "MoELayer")

    class DistMoEMoELayer(MoELayer):
        """Megatron's MoELayer whose tokens travel through dist-moe's dispatcher, routed by its router
        (``DistMoERouter.prepare`` / ``routed`` / ``record``)."""

        pipeline_chunks = OfExchange("chunks")
        traffic, reset_traffic = ExchangeTraffic(), OfExchange("reset_traffic")

        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *,
                     exchange: ExchangeConfig | None = None, topology: Topology | None = None):
            exchange = exchange if exchange is not None else ExchangeConfig()
            _check_config(config)
            super().__init__(config, submodules, layer_number, pg_collection)
            if not isinstance(self.router, DistMoERouter):
                raise ValueError(f"dist_moe_mlp_spec needs a DistMoERouter at mlp.router, got "
                                 f"{type(self.router).__name__}")
            if self.moe_layer_recompute or self.shared_experts_recompute:
                raise ValueError("config.recompute_modules 'moe' / 'shared_experts' recompute Megatron's own "
                                 "dispatch; dist-moe's dispatcher keeps its own chunk graphs: leave them out")
            world = self.ep_group.size()
            self.topology = topology if topology is not None else Topology.launched(world)
            self.topology.check_ranks(world, "the expert-parallel group")
            self.placement: Placement = self.router.placement
            bind_to_topology(self.router.router, self.placement, self.topology)
            self.dedup = exchange.dedup
            # ranks that route different tokens beyond this EP group (data parallelism) agree too
            agree_group = self.router.agree_group
            wider = agree_group if agree_group is not None and agree_group.size() > world else None
            self.exchange = exchange.build(self.ep_group, self.placement, self.topology, wider, "DistMoERouter")
            self.routed_experts = MegatronExperts(self.experts)
            self.forwards = 0  # the exchanges' tag (dist_moe/dispatch/agree.py)

        def forward(self, hidden_states: Tensor, intermediate_tensors=None, padding_mask: Tensor | None = None):
            """hidden [S, B, H], padding_mask [B, S] (True at padding) -> (output [S, B, H], None)."""
            if intermediate_tensors is not None:
                raise ValueError("partial CUDA-graph capture of the MoE layer needs Megatron's own dispatcher")
            if padding_mask is not None:  # Megatron's layers pass [B, S]; its routers see [S, B]
                padding_mask = padding_mask.transpose(0, 1).bool()
            if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
                raise ValueError("MoE with tensor parallelism needs sequence_parallel in training (as Megatron's "
                                 "MoELayer requires)")
            self.forwards += 1
            router = self.router  # a DistMoERouter
            tokens = router.prepare(hidden_states, padding_mask, self.forwards)
            shared = self.shared_experts if self.use_shared_expert else None
            y, routing = moe_forward(tokens, router.routed, router.router, self.exchange, self.routed_experts, shared)
            router.record(tokens, routing)  # the tracked aux loss and the last routing: once the forward went on
            return y.reshape(hidden_states.shape), None

        def _apply(self, fn, *args, **kwargs):
            out = super()._apply(fn, *args, **kwargs)
            self.routed_experts.restack()  # .to() and .bfloat16() give every parameter a storage of its own
            return out

    return DistMoEMoELayer


def _check_config(config) -> None:
    """What the layer cannot honour with dist-moe's dispatcher, refused before anything is built."""
    refused = {"moe_expert_capacity_factor": "dist-moe's dispatcher is dropless here; set it to None",
               "moe_latent_size": "latent projections need Megatron's own dispatcher",
               "moe_apply_probs_on_input": "dist-moe gates the experts' outputs, not their inputs",
               "moe_shared_expert_overlap": "the shared experts already run while the first chunks are in flight"}
    for name, why in refused.items():
        value = getattr(config, name, None)
        if value not in (None, False, 0):
            raise ValueError(f"config.{name}={value!r}: {why}")
    if (getattr(config, "expert_tensor_parallel_size", None) or 1) > 1:
        raise ValueError(f"config.expert_tensor_parallel_size={config.expert_tensor_parallel_size}: tensor-parallel "
                         "experts leave their reduction to Megatron's dispatcher; dist-moe's needs 1")


def dist_moe_mlp_spec(router: RouterConfig | dict, dedup: str = "rank", pipeline_chunks: int = 1,
                      placement: Placement | None = None, topology: Topology | None = None, base=None, timeout=None,
                      exchange: ExchangeConfig | None = None):
    """A ModuleSpec for the MoE MLP of Megatron's GPT layer specs, with dist-moe's router and dispatcher.

    ``base``: the spec it replaces (``spec.submodules.mlp``), whose experts and shared experts are
    kept; None builds ``get_moe_module_spec(use_te=False)``'s SequentialMLP experts.
    ``topology=None`` reads the launch topology (``Topology.launched``: torchrun's or DeepSpeed's
    variables, or ``DIST_MOE_TOPOLOGY``) of the expert-parallel group. ``timeout`` (a timedelta)
    bounds the collectives of node dedup's per-node groups (None: torch's default). ``exchange``: an
    ``ExchangeConfig`` giving dedup, pipeline_chunks and timeout at once instead.
    """
    megatron_patches.apply()
    MoESubmodules = engine_import("megatron.core.transformer.moe.moe_layer", "MoESubmodules")
    ModuleSpec = engine_import("megatron.core.transformer.spec_utils", "ModuleSpec")

    if not isinstance(router, (dict, RouterConfig)):
        raise ValueError(f"router must be a config (built per layer), got {type(router).__name__}")
    if base is None:
        get_moe_module_spec = engine_import("megatron.core.models.gpt.moe_module_specs", "get_moe_module_spec")

        base = get_moe_module_spec(use_te=False, num_experts=1, moe_grouped_gemm=False)  # experts' count: config's
    sub = base.submodules
    router = dict(router) if isinstance(router, dict) else router  # a user's dict may change later; a config cannot
    submodules = MoESubmodules(experts=sub.experts, shared_experts=sub.shared_experts,
                               router=functools.partial(DistMoERouter, router=router, placement=placement))
    return ModuleSpec(module=layer_class(), submodules=submodules,
                      params={"exchange": exchange or ExchangeConfig(dedup, pipeline_chunks, timeout=timeout),
                              "topology": topology})


def megatron_dist_moe_layer(config, router: RouterConfig | dict, dedup: str = "rank", pipeline_chunks: int = 1,
                            placement: Placement | None = None, topology: Topology | None = None, pg_collection=None,
                            exchange: ExchangeConfig | None = None):
    """One Megatron MoELayer (SequentialMLP experts) built from ``dist_moe_mlp_spec``, outside a GPTModel
    (benchmarks, tests). Needs ``parallel_state.initialize_model_parallel`` first."""
    build_module = engine_import("megatron.core.transformer.spec_utils", "build_module")

    spec = dist_moe_mlp_spec(router, dedup, pipeline_chunks, placement, topology, exchange=exchange)
    return build_module(spec, config=config, pg_collection=pg_collection)
