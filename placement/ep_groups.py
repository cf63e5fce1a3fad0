"""Expert-parallel groups smaller than the world: which ranks share one layer's experts out among them (an
EP group), which ranks hold the same experts (a replica group), the topology an EP group sees, and the
bytes that summing the experts' gradients over a replica group sends across each topology level.

``ExpertLayout(topology, ep_size, "contiguous")`` puts consecutive ranks in an EP group (inside a node
when the group fits one: Megatron-core's and DeepSpeed's order); ``"strided"`` takes every R-th rank
(R = world / ep_size replicas), so a group spreads over the nodes and its replicas sit side by side. On
2 nodes x 2, EP 2 contiguous is groups {0, 1} and {2, 3}, replicas {0, 2} and {1, 3}; strided the
other way round. Pure arithmetic: no process group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from placement.names import EP_LAYOUTS as LAYOUTS
from placement.topology import Topology


@dataclass(frozen=True)
class ExpertLayout:
    topology: Topology  # the launch's
    ep_size: int
    layout: str = "contiguous"

    def __post_init__(self):
        world = self.topology.world_size
        if self.layout not in LAYOUTS:
            raise ValueError(f"parallel.ep_layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if not 1 <= self.ep_size <= world or world % self.ep_size:
            raise ValueError(f"parallel.ep_size={self.ep_size} must divide the world of {world} ranks")
        for ranks in self.ep_groups():
            group_topology(self.topology, ranks)  # a group that is no block of the topology is refused here

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def replicas(self) -> int:
        return self.world_size // self.ep_size

    def ep_groups(self) -> list[list[int]]:
        """Every EP group's ranks, each in rank order (its members' positions are their group ranks)."""
        ep, r = self.ep_size, self.replicas
        if self.layout == "contiguous":
            return [[g * ep + i for i in range(ep)] for g in range(r)]
        return [[j + r * i for i in range(ep)] for j in range(r)]

    def replica_groups(self) -> list[list[int]]:
        """Every replica group's ranks: the ranks at one position of every EP group, which hold the same
        experts and sum their gradients."""
        return [list(ranks) for ranks in zip(*self.ep_groups())]

    def ep_group_of(self, rank: int) -> list[int]:
        return next(g for g in self.ep_groups() if rank in g)

    def replica_group_of(self, rank: int) -> list[int]:
        return next(g for g in self.replica_groups() if rank in g)

    def group_topology(self, rank: int) -> Topology:
        """The topology ``rank``'s EP group sees: its nodes and its ranks per node, the launch's link costs."""
        return group_topology(self.topology, self.ep_group_of(rank))

    def describe(self) -> str:
        if self.replicas == 1:
            return f"EP {self.ep_size} (the world)"
        return f"EP {self.ep_size} x {self.replicas} replicas ({self.layout})"


def group_topology(topology: Topology, ranks: list[int]) -> Topology:
    """``ranks`` (in rank order) as a topology of their own: at each level the count of distinct coordinates
    under one parent, the same under every parent, and member i at the i-th mixed-radix position; else a
    ValueError (a group that is no regular block of the topology has no node layout of its own)."""
    coords = [topology.coords(r) for r in ranks]
    sizes, siblings = [], []  # siblings[depth]: parent prefix -> its members' coordinates there, sorted
    for depth in range(len(topology.levels)):
        under: dict[tuple, set] = {}
        for c in coords:
            under.setdefault(c[:depth], set()).add(c[depth])
        counts = {len(values) for values in under.values()}
        if len(counts) != 1:
            raise ValueError(f"the expert-parallel group of ranks {ranks} holds an uneven number of "
                             f"{topology.levels[depth]}s per {topology.levels[depth - 1]} on {topology.describe()}")
        sizes.append(counts.pop())
        siblings.append({prefix: {v: i for i, v in enumerate(sorted(values))} for prefix, values in under.items()})
    sub = Topology(topology.levels, tuple(sizes), topology.cost)
    if math.prod(sizes) != len(ranks) or any(_position(siblings, c) != i for i, c in enumerate(coords)):
        raise ValueError(f"the expert-parallel group of ranks {ranks} is not a regular block of {topology.describe()}")
    return sub


def _position(siblings: list[dict], c: tuple) -> int:
    """Member ``c``'s mixed-radix position in its group: each coordinate ranked among its siblings'."""
    pos = 0
    for depth, value in enumerate(c):
        rank_of = siblings[depth][c[:depth]]
        pos = pos * len(rank_of) + rank_of[value]
    return pos


def ring_sends(ranks: list[int], position: int, elements: int, element_size: int,
               topology: Topology) -> tuple[str | None, int]:
    """(the topology level it crosses, bytes) that the rank at ``position`` of ``ranks`` (in ring order) sends
    to the next in a ring all-reduce of ``elements``: the buffer in len(ranks) chunks (the first
    ``elements % n`` one element longer, as ``torch.tensor_split`` cuts); in the reduce-scatter it sends every
    chunk but (position + 1) mod n, in the all-gather every chunk but (position + 2) mod n."""
    n = len(ranks)
    if n < 2 or not elements:
        return None, 0
    def chunk(i: int) -> int:  # computed, not listed: a ring of thousands of ranks asks n times
        return elements // n + (i < elements % n)

    sent = 2 * elements - chunk((position + 1) % n) - chunk((position + 2) % n)
    return topology.crossing_level(ranks[position], ranks[(position + 1) % n]), sent * element_size


def ring_allreduce_bytes(ranks: list[int], elements: int, element_size: int, topology: Topology) -> dict[str, int]:
    """Bytes a ring all-reduce of ``elements`` over ``ranks`` sends across each topology level, every rank's
    ``ring_sends`` together: 2 (n - 1) x the buffer, whatever the chunks."""
    out = {level: 0 for level in topology.levels}
    for position in range(len(ranks)):
        level, sent = ring_sends(ranks, position, elements, element_size, topology)
        if level is not None:
            out[level] += sent
    return out
