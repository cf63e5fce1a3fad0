"""Cluster topology, expert placement and exact byte accounting.

Runs without a process group, so a 1,024-GPU cluster can be simulated on a CPU. Its file IO (YAML
read safely, npz read without pickle, writes that are atomic and never follow a symlink) is public
too: ``dist_moe`` reads and writes its own files with it.
"""
from placement.cost import CostModel, LevelCost, fit_level
from placement.files import check_output_file, parse_yaml, read_npz, read_yaml, write_atomic, yaml_problem
from placement.locality import busiest, node_share, random_pair_tree_distance, tree_distance
from placement.placement import Placement, cut_weight
from placement.plan import DispatchPlan
from placement.topology import Topology
from placement.traffic import Traffic, dispatch_traffic, wire_row_bytes

__all__ = [
    "Topology", "Placement", "Traffic", "dispatch_traffic", "tree_distance", "random_pair_tree_distance", "node_share",
    "busiest", "CostModel", "LevelCost", "fit_level", "cut_weight", "DispatchPlan",
    "check_output_file", "parse_yaml", "read_npz", "read_yaml", "write_atomic", "yaml_problem", "wire_row_bytes",
]
