"""dist-moe's hosts inside megatron-core (written against 0.16.1), beside the layer spec (``layer.py``)
and the router swap (``router.py``): a ``TransformerConfig`` for one MoE layer (``megatron_config``),
Megatron's layer with the router swap (``megatron_moe_layer``), weight and gradient converters, and
the trainer's host (``MegatronHostedMoE``).
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch
from torch import Tensor

import dist_moe.integrations.megatron.patches as megatron_patches
from dist_moe.integrations.hosted import call_engine
from dist_moe.integrations.megatron.layer import megatron_dist_moe_layer
from dist_moe.integrations.megatron.patches import DISPATCHERS
from dist_moe.integrations.megatron.router import DistMoERouter
from dist_moe.moe.layer import MoELayerConfig
from dist_moe.moe.view import MoEView, expert_locations
from dist_moe.optional_engines import engine_import
from dist_moe.routing import Router
from dist_moe.routing.registry import RouterConfig, router_shape
from placement import Placement, Topology


def megatron_config(hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int, ep_size: int = 1,
                    expert_type: str = "swiglu", device: torch.device | None = None, **overrides):
    """A TransformerConfig for one MoE layer whose experts compute dist-moe's expert math
    (``top_k`` is the strategy's: Megatron sizes its dropless buffers with it); ``overrides``: any of
    TransformerConfig's fields, e.g. ``moe_token_dispatcher_type`` (Megatron's dispatcher, alltoall by
    default)."""
    dispatcher = overrides.get("moe_token_dispatcher_type", "alltoall")
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
    if expert_type not in ("swiglu", "gelu"):
        raise ValueError(f"Megatron experts map dist-moe's swiglu or gelu experts, got {expert_type!r}")
    megatron_patches.apply()
    TransformerConfig = engine_import("megatron.core.transformer", "TransformerConfig")

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
    with _without_default_scope_note(given="cuda_graph_scope" in overrides):
        return TransformerConfig(**fields)


# 0.16.1: every TransformerConfig left at Megatron's own default cuda_graph_scope ("full") warns that it is deprecated
DEFAULT_SCOPE_NOTE = r"full scope is deprecated"


@contextlib.contextmanager
def _without_default_scope_note(given: bool):
    """The note dropped where the scope is Megatron's default, which the caller did not choose; a scope given
    in ``overrides`` keeps it."""
    with warnings.catch_warnings():
        if not given:
            warnings.filterwarnings("ignore", message=DEFAULT_SCOPE_NOTE, category=UserWarning)
        yield


def seed_model_parallel_rng(seed: int) -> None:
    """Megatron's named RNG streams seeded as its own training seeds them (``model_parallel_cuda_manual_seed``
    after ``initialize_model_parallel``; ``seed + 100 * pipeline rank``, one pipeline stage here): on a GPU
    (``use_cpu_initialization=False``) Megatron draws its experts' weights from the expert-parallel stream
    and its shared experts' from the model-parallel one, and raises when they were never added."""
    model_parallel_cuda_manual_seed = engine_import("megatron.core.tensor_parallel.random",
                                                    "model_parallel_cuda_manual_seed")
    model_parallel_cuda_manual_seed(seed)


def megatron_moe_layer(config, router: Router | RouterConfig | dict, placement: Placement | None = None,
                       pg_collection=None, topology=None):
    """Megatron's MoELayer (SequentialMLP experts) with a ``DistMoERouter``."""
    megatron_patches.apply()
    get_moe_module_spec = engine_import("megatron.core.models.gpt.moe_module_specs", "get_moe_module_spec")
    MoELayer = engine_import("megatron.core.transformer.moe.moe_layer", "MoELayer")

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


class MegatronHostedMoE(torch.nn.Module):
    """dist-moe's layer interface over a Megatron-hosted MoE: ``(y, aux) = layer(x, categories, token_ids,
    padding_mask)``. ``dispatcher``: one of Megatron's own (alltoall, allgather), or ``dist_moe``
    (``dist_moe_mlp_spec``'s layer: dist-moe's dispatcher moves the tokens as the config's ``exchange``
    says, so the layer has dedup, pipeline chunks and measured bytes, ``dispatched.traffic``, as
    dist-moe's own MoELayer does).

    Rows of ``x`` are Megatron's [S, B=1] tokens. The aux loss already reaches the
    router through Megatron's ``MoEAuxLossAutoScaler`` in the output's backward, so
    the returned aux is detached: adding it to a loss reports it without counting
    its gradient twice. Needs ``parallel_state.initialize_model_parallel`` first.
    """

    def __init__(self, config: MoELayerConfig, ep_size: int = 1, placement: Placement | None = None,
                 topology: Topology | None = None, *, dispatcher: str = "alltoall", device: torch.device | None = None):
        """``config``'s capacity_factor and shared experts are refused (Megatron's layer here is dropless,
        without shared experts)."""
        super().__init__()
        if config.capacity_factor is not None or config.shared_expert_hidden:
            raise ValueError("MegatronHostedMoE is dropless without shared experts: capacity_factor None and "
                             "shared_expert_hidden 0")
        shape = router_shape(config.router, ("hidden_size",))  # the router itself is built once, by Megatron
        own = dispatcher != "dist_moe"
        mc = megatron_config(config.hidden_size, config.ffn_hidden_size, shape.num_experts, shape.top_k, ep_size,
                             config.expert_type, device, moe_token_dispatcher_type=dispatcher if own else "alltoall",
                             moe_aux_loss_coeff=shape.aux_loss_coeff)  # Megatron's place for it
        self.hidden_size = config.hidden_size
        self.dispatcher_kind = dispatcher
        self.moe = (megatron_moe_layer(mc, config.router, placement, topology=topology) if own else
                    megatron_dist_moe_layer(mc, config.router, placement=placement, topology=topology,
                                            exchange=config.exchange))
        self.expert_node, self.expert_rank = expert_locations(self.moe.router.placement, topology)

    def forward(self, x: Tensor, categories: Tensor | None = None, token_ids: Tensor | None = None,
                padding_mask: Tensor | None = None):
        return call_engine(self._run, x, categories, token_ids, padding_mask)

    def _run(self, tokens: Tensor, padding: Tensor | None) -> tuple[Tensor, Tensor]:
        # Megatron's [S, B=1, H]; its layer takes the padding mask as [B, S] and transposes it
        y, _ = self.moe(tokens.unsqueeze(1), padding_mask=None if padding is None else padding.unsqueeze(0))
        return y.squeeze(1), self.moe.router.last_routing.aux_loss

    @property
    def dispatched(self):
        """Megatron's MoELayer when dist-moe's dispatcher moves its tokens (it counts their bytes), else None."""
        return self.moe if self.dispatcher_kind == "dist_moe" else None

    @property
    def router(self) -> Router:
        return self.moe.router.router

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    @property
    def last_routing(self):
        return self.moe.router.last_routing

    def expert_state_keys(self, prefix: str = "") -> dict:
        """Megatron's local experts, one plain tensor each, under dist-moe's checkpoint stems."""
        ids = self.moe.router.placement.local_experts(self.moe.ep_group.rank())
        return {f"{prefix}moe.experts.local_experts.{j}.{slot}": ([ids[j]], f"{prefix}experts.{slot}", False)
                for j, mlp in enumerate(self.moe.experts.local_experts) for slot, _ in mlp.named_parameters()}

    def moe_view(self):
        """Megatron's SequentialMLP experts as one template, in their own layout (fc1 holds the gate
        and up projections together; GAR: materialized observations)."""
        local = self.moe.experts.local_experts
        template = {"linear_fc1.weight": [m.linear_fc1.weight for m in local],
                    "linear_fc2.weight": [m.linear_fc2.weight for m in local]}
        ep = self.moe.ep_group if self.moe.ep_group.size() > 1 else None
        return MoEView(self.router, template, False, [p for m in local for p in m.parameters()],
                       self.moe.router.last_forward, ep, self.moe.ep_group.rank())
