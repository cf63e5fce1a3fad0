"""Cluster topology, expert placement and byte accounting; runs without a process group.

So far: locality metrics. Topology, Placement and dispatch_traffic follow (DESIGN 3.2).
"""
from placement.locality import random_pair_tree_distance, tree_distance

__all__ = ["tree_distance", "random_pair_tree_distance"]
