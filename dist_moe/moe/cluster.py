"""A router told where the cluster's boundaries are, where its config asks for them."""
from __future__ import annotations

from dist_moe.routing.base import Router
from placement import Placement, Topology


def bind_to_topology(router: Router, placement: Placement, topology: Topology) -> None:
    """DeepSeek-V3's ``node_limit`` groups (the experts of each node), BRANCH's ``subtree_limit`` by level
    (the tree depth of each level's units under tree-prefix placement). Every host calls it."""
    if (router.node_limit or router.needs_topology) and topology.world_size != placement.world_size:
        raise ValueError(f"topology {topology.describe()} has {topology.world_size} ranks but the expert-parallel "
                         f"group has {placement.world_size}: give the EP group's topology")
    if router.node_limit:
        router.set_expert_groups(placement.expert_nodes(topology))
    if router.needs_topology:
        tree = placement == Placement.tree_prefix(router.num_experts, topology)
        router.resolve_subtree_levels(topology.levels, topology.sizes, tree)
