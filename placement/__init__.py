"""Cluster topology, expert placement and exact byte accounting.

Runs without a process group, so a 1,024-GPU cluster can be simulated on a CPU.
"""
from placement.cost import CostModel, LevelCost, fit_level
from placement.locality import busiest, node_share, random_pair_tree_distance, tree_distance
from placement.placement import Placement, cut_weight
from placement.plan import DispatchPlan
from placement.topology import Topology
from placement.traffic import Traffic, dispatch_traffic

__all__ = [
    "Topology", "Placement", "Traffic", "dispatch_traffic", "tree_distance", "random_pair_tree_distance", "node_share",
    "busiest", "CostModel", "LevelCost", "fit_level", "cut_weight", "DispatchPlan",
]
