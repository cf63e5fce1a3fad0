"""BRANCH's training-time anchors (Fu et al., section 3, eq. 5-9): at every depth, the
arrival-weighted mean of the node scores over the batch, the data-parallel batch included.

A token's arrival weights at depth d are its tree masks there, which the probabilities of the
depths above give, and those use the statistics of their own depths: so the forward sums over
the ranks once per depth, in order, and the equations allow no fewer sums. The statistics'
gradient has no such order (the arrival weights are detached, eq. 5-6): every depth's is summed
over the ranks in one all-reduce in the backward, where summing each depth on its own would take
one per depth. So the statistics are computed first, without a graph, and then once more as one
differentiable expression of the node scores for all depths at once. The leaf masses follow
from the statistics as evaluation's follow from the EMA anchors (``placement.subtree.tree_probs``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from dist_moe.distributed.reductions import all_reduce_sum, sum_gradient_over

_TINY = torch.finfo(torch.float32).tiny


def batch_anchors(f: Tensor, depth: int, keep: Tensor | None, group) -> tuple[Tensor, Tensor]:
    """(statistic a [E-1], differentiable in ``f``; arrival mass [E-1]) for node scores f [T, E-1]
    on this rank, summed over ``group`` (None: this batch alone); ``keep`` [T] leaves padding out."""
    t = f.shape[0]
    with torch.no_grad():
        masks, arrivals, sums = f.new_ones(t, 1), [], []
        for d in range(depth):
            fd = f[:, (1 << d) - 1:(1 << (d + 1)) - 1]
            w = masks if keep is None else masks * keep.unsqueeze(1)
            # both sums in one collective per depth (the depths themselves are sequential)
            mass, weighted = all_reduce_sum(torch.cat([w.sum(0), (w * fd).sum(0)]), group).split(1 << d)
            p = torch.sigmoid(fd - weighted / mass.clamp_min(_TINY))
            masks = torch.stack((masks * (1 - p), masks * p), dim=2).reshape(t, 2 << d)
            arrivals.append(w)
            sums.append((mass, weighted))
        mass = torch.cat([m for m, _ in sums])
        weighted = torch.cat([s for _, s in sums])
    # this rank's weighted sums as a function of f; their value is every rank's, their gradient
    # every rank's too, in one all-reduce for all depths
    local = (torch.cat(arrivals, 1) * f).sum(0)
    return sum_gradient_over(local, weighted, group) / mass.clamp_min(_TINY), mass
