"""GAR's observations: (g_m, p_m) pairs collected during task-gradient accumulation.

Observation units (GAR, section 5.2 and appendix G.2):

group    a same-task example group (the paper's experiments, the default);
         g_m = grad l_m, p_m = the group's mean example summary.
example  each example n; g_n = grad of its own loss, p_n = its summary q_n.
token    each valid token; g_t = its local contribution to its example's
         gradient, p_t = its configured gate row. Padding positions are left out.

``loss_fn`` returns a group's mean example loss, so an example's own loss is the
group loss times the group's example count. Group observations in materialized
mode are read off each group's expert gradients as its backward delivers them (a
hook per expert parameter sums them over experts before autograd adds them into the
running sum); every other combination is built from block factors
(``dist_moe.gar.factors``).

Under expert parallelism every rank takes the same number of groups and the m-th
group of every rank is one unit (or holds the units of that forward): g sums the
template gradients of every rank's experts, p averages (or gathers) every rank's
examples of the unit, and units are numbered by (group, rank, local index), which
is the order of one process running the union of the groups. A rank's part of a unit
may be empty: it still runs the unit's forward and backward, whose exchanges every
rank joins.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dist_moe.distributed.reductions import all_reduce_sum, all_reduce_sum_, group_size
from dist_moe.gar.factors import SlotRows, factor_gram, factor_observations
from dist_moe.moe.experts import FactorCapture
from dist_moe.moe.view import MoEView, moe_views
from dist_moe.routing.gar import MODES, UNITS

_TAG_BITS = 32  # a row tag is (source rank << 32) | local unit index; -1: no unit


def expert_parallel_group(layers):
    """The process group the MoE layers dispatch over, or None when they all run locally."""
    groups = {id(site.group): site.group for site in layers if site.group is not None}
    if not groups:
        return None
    if len(groups) > 1 or any(site.group is None for site in layers):
        raise ValueError("GAR needs every MoE layer on the same expert-parallel group")
    return next(iter(groups.values()))


def template_gradient(experts) -> Tensor:
    """Flattened sum over experts of each stacked parameter's gradient (one slot per parameter)."""
    parts = []
    for p in experts.template().values():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        parts.append(g.sum(0).flatten())
    return torch.cat(parts)


def example_rows(summary: Tensor, layout) -> Tensor:
    """q_n [examples, E]: each example's valid tokens averaged; fully padded examples left out.

    ``layout`` is (leading shape, padding mask or None) as the MoE layer saw the input:
    [B] means one token per example, [B, S] means S token positions per example.
    """
    shape, padding = layout
    if len(shape) <= 1:
        return summary
    # positions spelled out, not -1: a rank's empty part of a unit (0 examples) reshapes too
    q = summary.reshape(shape[0], math.prod(shape[1:]), summary.shape[-1])
    if padding is None:
        return q.mean(1)
    valid = (~padding.reshape(shape[0], math.prod(shape[1:]))).to(q.dtype).unsqueeze(-1)
    per_example = (q * valid).sum(1) / valid.sum(1).clamp_min(1)
    return per_example[valid.sum((1, 2)) > 0]


def example_sum(summary: Tensor, layout) -> tuple[Tensor, int]:
    """(sum over examples of q_n, number of examples)."""
    rows = example_rows(summary, layout)
    return rows.sum(0), rows.shape[0]


def example_mean(summary: Tensor, layout) -> Tensor:
    """p_m: average each example's valid tokens (q_n), then average the examples (step 5)."""
    total, count = example_sum(summary, layout)
    return total / count


def unit_rows(summary: Tensor, layout, unit: str) -> Tensor:
    """The p rows of one forward's units: per example (q_n) or per valid token."""
    if unit == "example":
        return example_rows(summary, layout)
    _, padding = layout
    return summary if padding is None else summary[~padding.reshape(-1)]


def local_unit_ids(layout, unit: str, device=None) -> tuple[Tensor, int]:
    """([T] index of each token's unit among this forward's units (the order of ``unit_rows``),
    -1 for none; the number of units)."""
    shape, padding = layout
    t = math.prod(shape)
    if padding is not None:
        device = padding.device if device is None else device
    valid = torch.ones(t, dtype=torch.bool, device=device) if padding is None else ~padding.reshape(-1).to(device)
    if unit == "token" or len(shape) <= 1:
        return torch.where(valid, torch.cumsum(valid, 0) - 1, -1), int(valid.sum())
    per_example = valid.reshape(shape[0], math.prod(shape[1:]))
    keep = per_example.any(1)
    example_id = torch.where(keep, torch.cumsum(keep, 0) - 1, -1)
    # every row of a kept example, padding too: its gradient is the example's whole gradient
    return example_id.repeat_interleave(per_example.shape[1]), int(keep.sum())


def _source_tagger(rank: int, unit: str):
    def tags(shape, padding, device=None):
        ids, _ = local_unit_ids((tuple(shape), padding), unit, device)
        return torch.where(ids >= 0, (rank << _TAG_BITS) | ids, -1)

    return tags


def router_summary(routing) -> Tensor:
    """Per-token configured gate distribution [T, E]: selected gates renormalised to sum 1.

    With one expert per token that distribution is one-hot and has no gradient; as in
    the paper's top-1 extension (appendix D.4) its derivative is then the full
    distribution's (straight-through): value one-hot, gradient d probs.
    """
    dense = routing.dense_gates()
    summary = dense / dense.sum(1, keepdim=True).clamp_min(torch.finfo(dense.dtype).tiny)
    if routing.expert_idx.shape[1] == 1:
        summary = summary.detach() + routing.probs - routing.probs.detach()
    return summary


def group_route_summaries(router, router_inputs, group=None) -> Tensor:
    """P [M, E] for group units: the router summary recomputed from detached inputs (steps 4-5).

    The recomputation runs the router in its training mode, so a Switch router's input
    jitter is drawn afresh here (the configured rule, not the forward's exact noise).
    With a process group the unit's examples on every rank are averaged together.
    """
    with router.frozen_state():  # recomputation must not move anchors, biases or schedules again
        parts = [example_sum(router_summary(router(h, **extras)), layout) for h, extras, layout in router_inputs]
    sums = torch.stack([s for s, _ in parts])
    counts = torch.tensor([float(c) for _, c in parts], dtype=sums.dtype, device=sums.device)
    return all_reduce_sum(sums, group) / all_reduce_sum(counts, group).unsqueeze(1)


@dataclass
class Observations:
    """What one GAR update collects per MoE layer during task-gradient accumulation."""

    layers: list
    router_inputs: list  # [layer][group] -> (detached router input [T, H], router extras, token layout)
    G: list  # [layer] -> [M, d] observations (materialized) or None
    W: list  # [layer] -> [M, M] Gram matrix (gram) or None
    task_loss: float
    mode: str
    unit: str = "group"
    group: object = None  # the expert-parallel process group, if any
    rank: int = 0
    offsets: list = field(default_factory=list)  # [layer] -> [groups, world] first global unit id

    def route_summaries(self, li: int) -> Tensor:
        """P [M, E] of layer ``li``, differentiable in its router parameters only."""
        router, inputs = self.layers[li].router, self.router_inputs[li]
        if self.unit == "group":
            return group_route_summaries(router, inputs, self.group)
        offsets = self.offsets[li]
        with router.frozen_state():  # as for groups: no second move of router state
            rows = [unit_rows(router_summary(router(h, **extras)), layout, self.unit) for h, extras, layout in inputs]
        ids = torch.cat([offsets[m, self.rank] + torch.arange(r.shape[0], device=offsets.device)
                         for m, r in enumerate(rows)])
        rows = torch.cat(rows)
        P = rows.new_zeros(self._num_units(li), rows.shape[1]).index_add(0, ids.to(rows.device), rows)
        return all_reduce_sum(P, self.group)  # every rank's units, each filled by its own rank

    def _num_units(self, li: int) -> int:
        return self.G[li].shape[0] if self.G[li] is not None else self.W[li].shape[0]


# one pass, each branch one case it handles (complexity above the lint's 15, kept whole)
def collect_observations(model, groups, loss_fn, weights, mode="materialized", sizes=None,  # noqa: C901
                         unit="group") -> Observations:
    """Accumulate grad(L_task), L_task = sum_m w_m l_m, one group at a time (steps 1-3).

    ``sizes`` (examples of each group on this rank) is required under expert
    parallelism; without it a group's example count is its leading dimension.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    if len(weights) != len(groups) or not groups:
        raise ValueError(f"need one weight per group: {len(weights)} weights for {len(groups)} groups")
    if any(not w > 0 for w in weights):
        raise ValueError(f"group weights must be > 0, got {list(weights)}")
    layers = moe_views(model)
    for site in layers:  # GAR recomputes the routers from their inputs: each layer keeps its last from now on
        site.last_forward.keep_inputs = True
    if not layers:
        raise ValueError("GAR found no MoELayer in the model")
    ep = expert_parallel_group(layers)
    rank = layers[0].rank if ep is not None else 0
    if ep is not None and (sizes is None or len(sizes) != len(groups) or any(int(n) < 0 for n in sizes)):
        raise ValueError("under expert parallelism pass sizes=[examples of each group on this rank], "
                         f"each >= 0 (got {sizes!r})")
    totals = None
    if sizes is not None:
        totals = all_reduce_sum(torch.tensor([float(n) for n in sizes], dtype=torch.float64), ep).tolist()
        if any(t < 1 for t in totals):  # a rank's part of a unit may be empty, the unit may not
            raise ValueError(f"every group needs an example on some rank: examples per group {totals}")
    shares = list(weights) if ep is None else [w * n / t for w, n, t in zip(weights, sizes, totals)]
    reads_grads = mode == "materialized" and unit == "group"
    if not reads_grads and any(site.experts is None for site in layers):
        raise ValueError(f"GAR mode={mode!r} unit={unit!r} builds observations from dist-moe's expert factors; "
                         "an engine-hosted layer supports mode='materialized' with unit='group'")
    template = [site.template for site in layers]
    G = [None] * len(layers)
    rows = [{name: [] for name in t} for t in template]  # factor rows per layer and slot
    inputs = [[] for _ in layers]
    task_loss = 0.0
    if reads_grads:
        device = next(p for params in template[0].values() for p in params).device
        G = [torch.zeros(len(groups), sum(site.slot_numel()), device=device) for site in layers]
    for m, (batch, w, share) in enumerate(zip(groups, weights, shares)):
        hooks = [h for li, site in enumerate(layers) for h in _read_template(site, G[li][m])] if reads_grads else []
        for site in layers:
            if not reads_grads:
                site.experts.capture = FactorCapture(None if unit == "group" else _source_tagger(rank, unit))
        try:
            loss = loss_fn(model, batch)
            (share * loss).backward()
        finally:
            for hook in hooks:
                hook.remove()
            captures = [site.experts.capture if site.experts is not None else None for site in layers]
            for site in layers:
                if site.experts is not None:
                    site.experts.capture = None
        task_loss += share * float(loss.detach())
        for li, site in enumerate(layers):
            h, extras, layout = site.last_forward.inputs()
            inputs[li].append((h, dict(extras), layout))
            if reads_grads:
                G[li][m].div_(w)
            else:
                # a unit's own loss is the group's mean loss times its example count
                count = totals[m] if totals is not None else layout[0][0] if layout[0] else 1
                scale = w if unit == "group" else w / count
                _keep_rows(rows[li], captures[li], scale, m)
    for g in G:  # every rank's experts enter the template sum: one reduction per layer
        if g is not None:
            all_reduce_sum_(g, ep)
    if ep is not None:
        task_loss = float(all_reduce_sum(torch.tensor(task_loss, dtype=torch.float64), ep))
    obs = Observations(layers, inputs, G, [None] * len(layers), task_loss, mode, unit, ep, rank)
    if not reads_grads:
        _finish_factor_rows(obs, rows, template, len(groups))
    return obs


def _read_template(site: MoEView, row: Tensor) -> list:
    """Hooks that add each slot's fresh gradient, summed over experts, into ``row`` (zeros) as the
    backward delivers it, before autograd adds it into the running sum: one pass over each expert
    gradient per group, and the accumulation itself stays the plain one. Returns the hooks' handles."""
    handles, start = [], 0
    for params, n in zip(site.template.values(), site.slot_numel()):
        shape = params[0].shape[1:] if site.stacked else params[0].shape
        out = row[start : start + n].view(shape)
        for p in params:
            handles.append(p.register_hook(_adder(out, site.stacked)))
        start += n
    return handles


def _adder(out: Tensor, stacked: bool):
    def add(grad: Tensor) -> None:
        out.add_(grad.sum(0) if stacked else grad)

    return add


def _keep_rows(rows: dict, capture, scale: float, m: int) -> None:
    """Move one group's captured factors into per-slot lists of (x, delta / scale, m, tags)."""
    for slot, xs in capture.inputs.items():
        tags = capture.tags.get(slot, [None] * len(xs))
        for x, d, tag in zip(xs, capture.grads[slot], tags):
            if d is not None:  # a block output that received no gradient
                rows[slot].append((x, d / scale, m, tag))


def _finish_factor_rows(obs: Observations, rows: list, template: list, num_groups: int) -> None:
    """Number the units globally and build G or W for every layer."""
    world = group_size(obs.group)
    for li, site in enumerate(obs.layers):
        device = site.last_forward.inputs()[0].device
        counts = torch.zeros(num_groups, world, dtype=torch.long, device=device)
        if obs.unit == "group":
            counts[:, 0] = 1  # unit m is group m, on whichever rank its rows ran (offsets[m, 0] = m)
        else:
            for m, (_, _, layout) in enumerate(obs.router_inputs[li]):
                counts[m, obs.rank] = local_unit_ids(layout, obs.unit)[1]
            all_reduce_sum_(counts, obs.group)
        flat = counts.flatten()
        offsets = (torch.cumsum(flat, 0) - flat).reshape(num_groups, world)
        obs.offsets.append(offsets)
        num_units = int(flat.sum())
        slots = {}
        for slot, (p,) in template[li].items():
            kept = []
            for x, d, m, tag in rows[li][slot]:
                if tag is None:
                    unit = torch.full((x.shape[0],), m, dtype=torch.long, device=device)
                else:
                    ok = tag >= 0
                    x, d, tag = x[ok], d[ok], tag[ok]
                    unit = offsets[m][tag >> _TAG_BITS] + (tag & ((1 << _TAG_BITS) - 1))
                kept.append(SlotRows(x, d, unit))
            a, b = p.shape[1:]
            slots[slot] = (SlotRows(torch.cat([r.x for r in kept]), torch.cat([r.delta for r in kept]),
                                    torch.cat([r.unit for r in kept])) if kept else SlotRows.empty(a, b, device))
        if obs.mode == "materialized":
            obs.G[li] = factor_observations(slots, num_units, obs.group)
        else:
            obs.W[li] = factor_gram(slots, num_units, obs.group)

