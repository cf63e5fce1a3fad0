"""Which expert-parallel layout a cluster should run: every ``ep_size`` that divides both the ranks and the
experts, with its groups of consecutive ranks (``contiguous``) or spread over the nodes (``strided``), priced
per training step (``dist-moe plan``, ``parallel.ep_size: auto``).

A layout's step is its group's exchanges and experts' matmuls (``forecast.group_forecast``: the fastest
placement x dedup x chunks row on the group's own topology, a shared link's bandwidth split among the groups
that exchange over it at once), plus the sum of the experts' gradients over
their replica groups: a ring all-reduce of each rank's experts (fp32 gradients), 2 (R - 1) messages of
1/R of them for R replicas, every message paying its level's alpha and its link's bytes over the
bandwidth, the ring's slowest level setting the pace (``ring_sends`` counts each rank's bytes per level;
a shared link carries every rank of its unit). The replicated weights' sum over the whole world is the
same for every layout; it is priced when their count is given. The gradient sums are priced as not
hidden behind the backward: an upper bound where they overlap it. A layout fits when each rank's experts
(fp32 weights, gradients and Adam's two moments, 16 bytes a parameter) and the replicated weights fit the
memory given per rank.
"""
from __future__ import annotations

import math

import torch

from placement.ep_groups import LAYOUTS, ExpertLayout
from placement.forecast import PLACEMENTS, ModelShape, group_forecast
from placement.topology import Topology

GRAD_BYTES = 4  # fp32 gradients, whatever the compute dtype
STATE_BYTES = 16  # per parameter: fp32 weight, gradient and Adam's two moments
BUCKET_BYTES = 25 * 2**20  # each sum's bucket, as the training step cuts them: one collective latency each


def expert_parameters(shape: ModelShape) -> int:
    """One expert's parameters (SwiGLU: 3 matrices of hidden x ffn)."""
    return 3 * shape.hidden * shape.ffn


def layouts_of(topology: Topology, experts: int) -> list[ExpertLayout]:
    """Every layout the topology and the expert count admit: ``ep_size`` dividing both, contiguous and
    strided where they differ (with one group, or groups of one rank, they are the same)."""
    out = []
    for ep in range(1, topology.world_size + 1):
        if topology.world_size % ep or experts % ep:
            continue
        for layout in LAYOUTS if 1 < ep < topology.world_size else LAYOUTS[:1]:
            try:
                out.append(ExpertLayout(topology, ep, layout))
            except ValueError:  # groups that are no regular block of the topology
                continue
    return out


def grad_sum_seconds(layout: ExpertLayout, elements: int) -> tuple[float, dict[str, int]]:
    """(seconds, bytes sent across each level summed over ranks) of the ring all-reduces of ``elements``
    gradients on every rank over its replica group, all groups at once."""
    topology = layout.topology
    levels = topology.levels
    sent, recv = ring_level_bytes(layout, elements)
    r = layout.replicas
    if r == 1 or not elements:
        return 0.0, {name: 0 for name in levels}
    messages = 2 * (r - 1)
    cost = topology.cost
    per_message = max(cost.levels[name].seconds(1, float(cost.link_load(i, topology, sent[i], recv[i]).max())
                                                / messages) for i, name in enumerate(levels) if float(sent[i].sum()))
    buckets = math.ceil(elements * GRAD_BYTES / BUCKET_BYTES)
    by_level = {name: int(sent[i].sum()) for i, name in enumerate(levels)}
    return messages * per_message + buckets * cost.latency_s, by_level


def ring_level_bytes(layout: ExpertLayout, elements: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[levels, world] bytes each rank sends and receives across each level in the ring all-reduces of
    ``elements`` gradients over its replica group: ``ring_sends`` for every rank at once (a plan prices
    thousands of ranks in each of its layouts)."""
    topology = layout.topology
    sent = torch.zeros(len(topology.levels), topology.world_size, dtype=torch.float64)
    recv = torch.zeros_like(sent)
    groups = torch.tensor(layout.replica_groups(), dtype=torch.long)  # [groups, n], each in ring order
    n = groups.shape[1]
    if n < 2 or not elements:
        return sent, recv
    after = groups.roll(-1, dims=1)  # the next rank of each ring
    rank = torch.arange(topology.world_size)
    columns: list[torch.Tensor] = []  # each level's coordinate of every rank
    for size in reversed(topology.sizes):
        columns.insert(0, rank % size)
        rank = rank // size
    coords = torch.stack(columns, dim=1)  # [world, levels]
    differ = coords[groups] != coords[after]
    level = differ.int().argmax(dim=-1)  # the outermost level that differs
    position = torch.arange(n)

    def chunk(i: torch.Tensor) -> torch.Tensor:  # torch.tensor_split's chunk sizes, as ring_sends counts them
        return elements // n + (i < elements % n).long()

    per_position = (2 * elements - chunk((position + 1) % n) - chunk((position + 2) % n)) * GRAD_BYTES
    nbytes = (per_position.double().expand(groups.shape) * differ.any(dim=-1)).flatten()
    sent.index_put_((level.flatten(), groups.flatten()), nbytes, accumulate=True)
    recv.index_put_((level.flatten(), after.flatten()), nbytes, accumulate=True)
    return sent, recv


def group_links(layout: ExpertLayout) -> Topology:
    """The topology one EP group sees, each shared link's bandwidth split among the groups that use it at once:
    every replica's group exchanges in the same layer at the same time, so a node's one link (its NIC) carries
    all of its groups' exchanges (EP 2 strided on 2 nodes x 2: two groups share each node's link)."""
    group, full = layout.group_topology(0), layout.topology
    overrides = {}
    for i, name in enumerate(full.levels):
        sharing = math.prod(full.sizes[i + 1:]) // math.prod(group.sizes[i + 1:])
        link = full.cost.levels[name]
        if link.shared and sharing > 1 and group.sizes[i] > 1:
            overrides[name] = {"bandwidth_Bps": link.bandwidth_Bps / sharing}
    return Topology(group.levels, group.sizes, full.cost.updated(overrides)) if overrides else group


def price_layouts(shape: ModelShape, topology: Topology, routing=None, tflops: float = 400.0, sample: int | None = None,
                  chunks=(1,), memory_bytes: float = math.inf, dense_parameters: int = 0) -> dict:
    """Every layout's predicted step (with its fastest placement x dedup x chunks row; ``rows``: each such
    row's MoE seconds), fastest first among those that fit ``memory_bytes`` per rank, and the recommended one
    (the fastest that fits; None when none does)."""
    dense_s = grad_sum_seconds(ExpertLayout(topology, 1), dense_parameters)[0] if dense_parameters else 0.0
    rows = []
    for layout in layouts_of(topology, shape.experts):
        group = group_links(layout)
        options = group_forecast(shape, group, routing, tflops, sample, PLACEMENTS, chunks)["rows"]
        best = min(options, key=lambda r: r["step_seconds"])
        experts_here = shape.layers * shape.experts // layout.ep_size * expert_parameters(shape)
        grad_s, grad_bytes = grad_sum_seconds(layout, experts_here)
        memory = STATE_BYTES * (experts_here + dense_parameters)
        rows.append({"ep": layout.ep_size, "layout": layout.layout, "replicas": layout.replicas,
                     "group": group.describe(), "placement": best["placement"], "dedup": best["dedup"],
                     "chunks": best["chunks"], "moe_seconds": best["step_seconds"], "grad_seconds": grad_s,
                     "grad_bytes_by_level": grad_bytes, "dense_seconds": dense_s,
                     "step_seconds": best["step_seconds"] + grad_s + dense_s, "memory_bytes": memory,
                     "fits": memory <= memory_bytes,
                     "rows": [{k: r[k] for k in ("placement", "dedup", "chunks", "step_seconds")} for r in options]})
    rows.sort(key=lambda r: (not r["fits"], r["step_seconds"]))
    return {"layouts": rows, "recommended": rows[0] if rows and rows[0]["fits"] else None}
