"""GAR observations from block factors (GAR, appendix G.2).

Every expert linear block ``out = x @ w[e]`` has the weight gradient
``sum_rows x_r delta_r^T``, so the common-template gradient of any observation
unit (a group, an example, a token) is the sum of ``x_r (x) delta_r`` over the
routed rows r that belong to it, whichever expert ran them. ``SlotRows`` holds
those rows for one template slot: x, delta already divided by the unit's loss
scale, and the global unit id of each row.

Two ways to use them: ``factor_observations`` builds the [M, d] matrix of g_m,
``factor_gram`` builds W = [<g_i, g_j>] without it, from
W_ij = sum_b sum_{r in i, r' in j} <delta_r, delta_r'> <x_r, x_r'>. Under expert
parallelism a rank's experts see rows of every rank's units: the partial
observations are summed over the group; for the Gram every rank gathers all
rows, pairs its own rows with them and the [M, M] partials are summed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dist_moe.distributed.reductions import all_gather_rows, all_reduce_sum_


@dataclass
class SlotRows:
    x: Tensor  # [R, a] block inputs
    delta: Tensor  # [R, b] output gradients of the unit's own loss
    unit: Tensor  # [R] int64 global unit ids

    @classmethod
    def empty(cls, a: int, b: int, device=None) -> SlotRows:
        return cls(torch.zeros(0, a, device=device), torch.zeros(0, b, device=device),
                   torch.zeros(0, dtype=torch.long, device=device))


def factor_observations(slots: dict[str, SlotRows], num_units: int, group=None) -> Tensor:
    """G [M, d]: row m is g_m, slots concatenated in template order (as ``template_gradient``)."""
    parts = []
    for rows in slots.values():
        a, b = rows.x.shape[1], rows.delta.shape[1]
        g = rows.x.new_zeros(num_units, a * b)
        if rows.x.shape[0]:
            outer = (rows.x.unsqueeze(2) * rows.delta.unsqueeze(1)).reshape(-1, a * b)
            g.index_add_(0, rows.unit, outer.to(g.dtype))
        parts.append(g)
    G = torch.cat(parts, 1)
    all_reduce_sum_(G, group)  # every rank's experts enter the template sum
    return G


def factor_gram(slots: dict[str, SlotRows], num_units: int, group=None) -> Tensor:
    """W [M, M] float64, exact: memory grows with rows^2 per slot, never with d."""
    device = next(iter(slots.values())).x.device
    W = torch.zeros(num_units, num_units, dtype=torch.float64, device=device)
    for rows in slots.values():  # every rank visits every slot: the gathers are collective
        x_all = all_gather_rows(rows.x, group)
        d_all = all_gather_rows(rows.delta, group)
        u_all = all_gather_rows(rows.unit, group)
        if not rows.x.shape[0] or not x_all.shape[0]:
            continue
        K = (rows.delta.double() @ d_all.double().t()) * (rows.x.double() @ x_all.double().t())
        mine = W.new_zeros(num_units, K.shape[1]).index_add_(0, rows.unit, K)
        W.index_add_(1, u_all, mine)
    all_reduce_sum_(W, group)
    return W
