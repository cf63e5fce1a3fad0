"""A transformers MoE model's experts, sharded and dispatched by dist-moe (``dist-moe train``'s
``model.kind: hf``; written against transformers 5.25).

``host_experts(model, ...)`` puts a ``HostedHFExperts`` where each MoE block's ``experts`` module was
(``mlp.experts`` in Mixtral, Qwen2/3-MoE, DeepSeek-V3, OLMoE, GPT-OSS). It keeps that module's
parameters under the same names, each stacked [E, ...] tensor cut to this rank's experts (the
placement's), so the model's state-dict keys stay transformers' own. The block's own router still
chooses (``gate``, GPT-OSS's ``router``: softmax top-k, DeepSeek-V3's group-limited sigmoid, ...)
and calls the host with ``(hidden_states, top_k_index, top_k_weights)``; the host sends the tokens through dist-moe's
dispatcher (dedup, pipelined chunks, bytes counted per topology level) to the experts' grouped GEMMs
(``StackedExperts``) and returns the weighted sum per token. It is also what the trainer, metrics and
checkpoints ask of every MoE layer (``dist_moe.moe.view.MoEHost``), with the model's router seen read-only.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from dist_moe.dispatch.exchange import ExchangeConfig
from dist_moe.distributed.groups import WeakGroup
from dist_moe.distributed.reductions import all_gather_rows
from dist_moe.integrations.transformers.ep import StackedExperts
from dist_moe.moe.chosen import ChosenRouter, chosen_route, chosen_tokens, kept_routing
from dist_moe.moe.forward import ExchangeTraffic, LastForward, OfExchange, moe_forward
from dist_moe.moe.view import MoEView, expert_locations
from placement import Placement, Topology

NO_INPUTS = ("model.kind=hf routes with the model's own router, whose inputs dist-moe does not keep "
             "(GAR needs them)")


class HostedHFExperts(nn.Module):
    """One MoE block's experts: this rank's rows of the stacked expert tensors, behind dist-moe's
    dispatcher. ``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])`` as the
    experts module it replaces."""

    group = WeakGroup()  # held weakly: torch.distributed owns the group (dist_moe/distributed/groups.py)
    pipeline_chunks = OfExchange("chunks")
    traffic, reset_traffic = ExchangeTraffic(), OfExchange("reset_traffic")

    def __init__(self, experts: nn.Module, gate: nn.Module, placement: Placement, topology: Topology, group,
                 exchange: ExchangeConfig):
        super().__init__()
        self.num_experts = experts.num_experts
        self.hidden_size = _hidden_size(experts)
        self.rank = torch.distributed.get_rank(group) if placement.world_size > 1 else 0
        self.local_expert_ids = placement.local_experts(self.rank)
        rows = torch.tensor(self.local_expert_ids, dtype=torch.long)
        self.expert_slots = []  # names of the stacked [E, ...] tensors, cut to this rank's rows
        with torch.no_grad():
            for name, p in list(experts.named_parameters(recurse=False)):
                if p.dim() and p.shape[0] == self.num_experts:
                    p = nn.Parameter(p.detach()[rows.to(p.device)].clone(), requires_grad=p.requires_grad)
                    setattr(experts, name, p)
                    self.expert_slots.append(name)
                self.register_parameter(name, p)
        for name, b in experts.named_buffers(recurse=False):
            self.register_buffer(name, b)
        for name, child in experts.named_children():  # the activation, a norm after the experts: shared
            self.add_module(name, child)
        experts.num_experts = len(self.local_expert_ids)  # the experts' own forward sees local ids
        # the original module computes (its gate layout, activation); not a submodule: its tensors are ours
        object.__setattr__(self, "_hf_experts", experts)
        self.routed_experts = StackedExperts(experts, experts.forward)
        self.router = ChosenRouter(type(gate).__name__, self.num_experts)
        self.placement, self.topology, self.dedup, self.group = placement, topology, exchange.dedup, group
        self.exchange = exchange.build(group, placement, topology)
        self.expert_node, self.expert_rank = expert_locations(placement, topology)
        self.forwards = 0  # the exchanges' tag (dist_moe/dispatch/agree.py)
        self.last_forward = LastForward(no_inputs=NO_INPUTS)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        self.forwards += 1
        tokens = chosen_tokens(hidden_states, top_k_index, top_k_weights, self.forwards)
        y, routing = moe_forward(tokens, chosen_route, self.router, self.exchange, self.routed_experts)
        self.last_forward.keep(tokens, kept_routing(routing, self.num_experts), inputs=False)
        return y

    @property
    def last_routing(self):
        return self.last_forward.routing


    # what the trainer, metrics and checkpoints ask of every MoE layer (dist_moe.moe.view.MoEHost)

    def moe_view(self) -> MoEView:
        params = {name: [getattr(self, name)] for name in self.expert_slots}
        ep = self.placement.world_size > 1
        return MoEView(self.router, params, True, [p for ps in params.values() for p in ps], self.last_forward,
                       self.group if ep else None, self.rank if ep else 0)

    def expert_state_keys(self, prefix: str = "") -> dict:
        return {f"{prefix}{name}": (self.local_expert_ids, f"{prefix}{name}", True) for name in self.expert_slots}

    def full_expert_tensors(self, keep: bool):
        """(slot, [E, ...] every expert's rows in expert order, on the CPU) per stacked slot, gathered from
        every rank one slot at a time (collective); with ``keep`` False this rank takes part and keeps nothing."""
        order = torch.tensor([e for r in range(self.placement.world_size) for e in self.placement.local_experts(r)])
        for name in self.expert_slots:
            rows = all_gather_rows(getattr(self, name).detach(), self.group if self.placement.world_size > 1 else None)
            if keep:
                full = torch.empty(rows.shape, dtype=rows.dtype)
                full[order] = rows.cpu()
                yield name, full
            del rows


def _hidden_size(experts: nn.Module) -> int:
    for name in ("hidden_dim", "hidden_size"):
        if isinstance(getattr(experts, name, None), int):
            return getattr(experts, name)
    return experts.down_proj.shape[1 if not getattr(experts, "is_transposed", False) else 2]


def moe_blocks(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(block, its router) of every MoE block whose experts dist-moe can host: a router (``gate``, or
    GPT-OSS's ``router``) beside an ``experts`` module holding stacked [E, ...] ``down_proj`` weights."""
    found = []
    for m in model.modules():
        experts = getattr(m, "experts", None)
        gate = next((g for g in (getattr(m, "gate", None), getattr(m, "router", None)) if isinstance(g, nn.Module)),
                    None)
        if isinstance(experts, HostedHFExperts):
            continue
        if isinstance(experts, nn.Module) and gate is not None and _stacked(experts):
            found.append((m, gate))
    return found


def _stacked(experts: nn.Module) -> bool:
    down = getattr(experts, "down_proj", None)
    return (isinstance(getattr(experts, "num_experts", None), int) and isinstance(down, nn.Parameter)
            and down.dim() == 3 and down.shape[0] == experts.num_experts)


def host_experts(model: nn.Module, placement_of, topology: Topology, group,
                 exchange: ExchangeConfig) -> list[HostedHFExperts]:
    """Replace every MoE block's experts in ``model`` with a ``HostedHFExperts`` (``placement_of(E)``
    gives each block's placement); returns them in module order."""
    hosts = []
    for block, gate in moe_blocks(model):
        host = HostedHFExperts(block.experts, gate, placement_of(block.experts.num_experts), topology, group,
                               exchange)
        block.experts = host
        hosts.append(host)
    return hosts
