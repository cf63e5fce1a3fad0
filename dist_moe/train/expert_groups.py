"""The process groups of a run whose expert-parallel groups are smaller than the world (``parallel.ep_size``):
this rank's EP group (its MoE layers' exchanges) and its replica group (the ranks holding the same experts,
which sum their gradients). ``new_group`` is collective over the whole world, so every rank creates every
group, in one order; each keeps its own, weakly (``distributed/groups.py``)."""
from __future__ import annotations

import datetime

import torch.distributed as dist

from dist_moe.distributed.groups import WeakGroup
from placement import Topology
from placement.ep_groups import ExpertLayout


class ExpertGroups:
    ep = WeakGroup()
    replicas = WeakGroup()

    def __init__(self, layout: ExpertLayout, rank: int, timeout: datetime.timedelta | None):
        self.layout, self.rank, self.timeout = layout, rank, timeout
        self.ep_ranks, self.replica_ranks = layout.ep_group_of(rank), layout.replica_group_of(rank)
        self.ep = _own(layout.ep_groups(), timeout)
        self.replicas = _own(layout.replica_groups(), timeout)

    @property
    def topology(self) -> Topology:
        """What this rank's EP group sees: its own nodes and ranks per node."""
        return self.layout.group_topology(self.rank)

    def new_replica_group(self):
        """Another communicator over this rank's replica group (every rank calls this together): the
        experts' gradient sums run on it, apart from the sums on the replica group itself."""
        return _own(self.layout.replica_groups(), self.timeout)


def _own(groups: list[list[int]], timeout):
    """Every group of ``groups`` created (by every rank, in order); this rank's returned."""
    mine, _ = dist.new_subgroups_by_enumeration(groups, timeout=timeout)
    return mine
