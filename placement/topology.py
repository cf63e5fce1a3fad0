"""Cluster topology: named levels, outermost first, and rank coordinates.

``Topology(("node", "gpu"), (2, 4))`` is 8 ranks, ranks 0-3 on node 0. A rank's
coordinates are the mixed-radix digits of the rank, so rank prefixes are
topology prefixes, the same way BRANCH-MoE's expert-index prefixes are tree
prefixes. Nothing here needs a process group.

The "node" of a rank is its coordinate prefix up to and including the level
named ``node`` (without such a level: every level but the innermost). Node
dedup sends one copy per node and needs equally many ranks on every node.
"""
from __future__ import annotations

import math
import os
import reprlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from placement.cost import CostModel
from placement.files import read_yaml_mapping


@dataclass(frozen=True)
class Topology:
    levels: tuple[str, ...]
    sizes: tuple[int, ...]
    cost: CostModel = field(default=None, compare=False)  # type: ignore[assignment]  # None: filled in __post_init__

    def __post_init__(self):
        levels, sizes = tuple(self.levels), tuple(self.sizes)
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "sizes", sizes)
        if not levels or len(levels) != len(sizes):
            raise ValueError(f"topology needs one size per level, got levels={levels} sizes={sizes}")
        if len(set(levels)) != len(levels) or not all(isinstance(n, str) and n for n in levels):
            raise ValueError(f"topology levels must be distinct non-empty names, got {levels}")
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
            raise ValueError(f"topology sizes must be positive ints, got {sizes}")
        if self.cost is None:
            object.__setattr__(self, "cost", CostModel.default(levels))
        else:
            self.cost.check_levels(levels)

    # --- shape ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def node_depth(self) -> int:
        """Number of leading levels that identify a node."""
        if "node" in self.levels:
            return self.levels.index("node") + 1
        return max(len(self.levels) - 1, 0)

    @property
    def num_nodes(self) -> int:
        return math.prod(self.sizes[: self.node_depth])

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.num_nodes

    def effective_dedup(self, dedup: str) -> str:
        """The dedup mode a dispatch runs here: node dedup with one node (or one rank per node) has no
        node boundary to send a copy across once, so it is rank dedup, the same bytes without a second
        exchange."""
        if dedup == "node" and (self.num_nodes == 1 or self.ranks_per_node == 1):
            return "rank"
        return dedup

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for a world of {self.world_size}")

    def coords(self, rank: int) -> tuple[int, ...]:
        self._check_rank(rank)
        out = []
        for size in reversed(self.sizes):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def local_index(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.ranks_per_node

    def gateway(self, src_rank: int, dst_node: int) -> int:
        """The rank on ``dst_node`` with ``src_rank``'s local index (node-dedup entry point)."""
        return dst_node * self.ranks_per_node + self.local_index(src_rank)

    def crossing_level(self, a: int, b: int) -> str | None:
        """Outermost level whose coordinate differs between ranks a and b (None if a == b)."""
        for name, ca, cb in zip(self.levels, self.coords(a), self.coords(b)):
            if ca != cb:
                return name
        return None

    def level_matrix(self):
        """[W, W] int64: index into ``levels`` of crossing_level(a, b), -1 on the diagonal (cached)."""
        if "_level_matrix" not in self.__dict__:  # frozen dataclass: cache beside the fields
            object.__setattr__(self, "_level_matrix", self._build_level_matrix())
        return self.__dict__["_level_matrix"]

    def _build_level_matrix(self):
        ranks = torch.arange(self.world_size)
        return self.crossing_levels(ranks.unsqueeze(1), ranks.unsqueeze(0))

    def crossing_levels(self, a, b):
        """Index into ``levels`` of the outermost level where rank tensors ``a`` and ``b`` differ
        (-1: the same rank), elementwise and broadcast: no [W, W] matrix unless asked for one."""
        out = torch.full(torch.broadcast_shapes(a.shape, b.shape), -1, dtype=torch.long)
        for i in reversed(range(len(self.sizes))):
            stride = math.prod(self.sizes[i + 1 :])
            out = torch.where(a // stride != b // stride, i, out)
        return out

    # --- construction ----------------------------------------------------------
    @classmethod
    def flat(cls, world_size: int) -> Topology:
        """One node with ``world_size`` ranks."""
        return cls(("node", "gpu"), (1, world_size))

    @classmethod
    def from_env(cls, override: str | None = None, env=None) -> Topology:
        """From launcher variables, or an explicit override such as ``"node=2,gpu=4"``.

        The override comes from the argument or ``DIST_MOE_TOPOLOGY``. Otherwise
        torchrun (WORLD_SIZE, LOCAL_WORLD_SIZE) or the DeepSpeed launcher
        (WORLD_SIZE, LOCAL_SIZE, CROSS_SIZE) describe ("node", "gpu").
        """
        env = os.environ if env is None else env
        spec = override or env.get("DIST_MOE_TOPOLOGY")
        world = env.get("WORLD_SIZE")
        if spec:
            topo = cls.parse_env(spec) if not override else cls.parse(spec)
        else:
            if world is None:
                raise ValueError("no topology: WORLD_SIZE is not set (not under torchrun/deepspeed); "
                                 "set DIST_MOE_TOPOLOGY=node=N,gpu=G")
            local = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE")
            if local is None:
                raise ValueError("WORLD_SIZE is set but neither LOCAL_WORLD_SIZE (torchrun) nor LOCAL_SIZE "
                                 "(deepspeed) is; set DIST_MOE_TOPOLOGY=node=N,gpu=G")
            world_i, local_i = int(world), int(local)
            if local_i < 1 or world_i % local_i:
                raise ValueError(f"WORLD_SIZE={world_i} is not a multiple of the per-node process count {local_i}")
            nodes = world_i // local_i
            if env.get("CROSS_SIZE") is not None and int(env["CROSS_SIZE"]) != nodes:
                raise ValueError(f"CROSS_SIZE={env['CROSS_SIZE']} disagrees with WORLD_SIZE/LOCAL_SIZE={nodes}")
            topo = cls(("node", "gpu"), (nodes, local_i))
        if world is not None and topo.world_size != int(world):
            raise ValueError(f"topology {topo.describe()} has {topo.world_size} ranks but WORLD_SIZE={world}")
        return topo

    @classmethod
    def launched(cls, world: int) -> Topology:
        """The launcher's topology when ``world`` is the launched world, else one node of ``world``."""
        if world > 1 and os.environ.get("WORLD_SIZE") == str(world):
            return cls.from_env()
        if os.environ.get("DIST_MOE_TOPOLOGY"):  # unused here, but a typo in it must not pass unnoticed
            cls.parse_env(os.environ["DIST_MOE_TOPOLOGY"])
        return cls.flat(world)

    @classmethod
    def parse_env(cls, spec: str) -> Topology:
        """``DIST_MOE_TOPOLOGY``'s value, or a ValueError naming the variable: a spec (``node=2,gpu=4``) or a
        topology file (``dist-moe calibrate --out``'s, with the measured link costs)."""
        try:
            return cls.from_yaml(spec) if spec.strip().endswith((".yaml", ".yml")) else cls.parse(spec)
        except ValueError as e:
            raise ValueError(f"DIST_MOE_TOPOLOGY={reprlib.repr(spec)}: {e}") from None

    @classmethod
    def parse(cls, spec: str) -> Topology:
        """``"rack=2,node=2,gpu=4"`` -> Topology(("rack", "node", "gpu"), (2, 2, 4))."""
        levels, sizes = [], []
        for part in spec.split(","):
            name, _, size = part.strip().partition("=")
            if not name or not size.strip().isdigit():
                raise ValueError(f"topology spec {spec!r}: each part must look like level=size")
            levels.append(name.strip())
            sizes.append(int(size))
        return cls(tuple(levels), tuple(sizes))

    @classmethod
    def from_yaml(cls, path: str | Path) -> Topology:
        """levels: [node, gpu]; sizes: [2, 4]; optional cost: {level: {alpha_s:, bandwidth_Bps:, shared:}}
        and exchange: {latency_s:, overlap:, chunked:} (``dist-moe calibrate`` writes both)."""
        data = read_yaml_mapping(path, "topology", required=("levels", "sizes"), optional=("cost", "exchange"))
        def refuse(key, want, value):
            raise ValueError(f"topology file {path}: {key!r} must be {want}, got {reprlib.repr(value)}")

        for key in ("levels", "sizes"):
            if not isinstance(data[key], list):
                refuse(key, "a list", data[key])
        levels = tuple(data["levels"])
        if not all(isinstance(n, str) and n for n in levels) or len(set(levels)) != len(levels):
            refuse("levels", "distinct names", levels)
        costs, exchange = data.get("cost") or {}, data.get("exchange") or {}
        for key, value in (("cost", costs), ("exchange", exchange)):
            if not isinstance(value, dict):
                refuse(key, "a mapping", value)
        for name, c in costs.items():
            if not isinstance(c, dict):
                refuse(f"cost.{name}", "a mapping", c)
        unknown = sorted(set(exchange) - {"latency_s", "overlap", "chunked", "calibrated"})
        if unknown:
            raise ValueError(f"{path}: unknown exchange key {unknown[0]!r}; valid: latency_s, overlap, chunked")
        try:  # the cost model checks every number against its range (cost.BOUNDS), naming the key
            cost = CostModel.default(levels).updated(costs).with_exchange(
                exchange.get("latency_s", 0.0), exchange.get("overlap", 0.0), exchange.get("chunked", 1.0))
        except ValueError as e:
            raise ValueError(f"topology file {path}: {e}") from None
        return cls(levels, tuple(data["sizes"]), cost)

    @classmethod
    def from_hostfile(cls, path: str | Path) -> Topology:
        """A DeepSpeed hostfile (``host slots=N`` per line) -> ("node", "gpu") with equal slots."""
        path = Path(path)
        if not path.exists():
            raise ValueError(f"hostfile {str(path)!r} does not exist")
        slots = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            found = [p for p in parts[1:] if p.startswith("slots=")]
            if len(parts) < 2 or not found or not found[0][6:].isdigit():
                raise ValueError(f"{path}:{lineno}: expected 'hostname slots=N', got {line!r}")
            slots.append(int(found[0][6:]))
        if not slots:
            raise ValueError(f"hostfile {path} lists no hosts")
        if len(set(slots)) != 1:
            raise ValueError(f"hostfile {path}: every host needs the same slots for expert parallelism, got {slots}")
        return cls(("node", "gpu"), (len(slots), slots[0]))

    def describe(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.levels, self.sizes))

    def check_ranks(self, world: int, what: str = "the group") -> None:
        """Refuse a topology of another size than the ranks it describes (``what``: those ranks, named)."""
        if self.world_size != world:
            raise ValueError(f"topology {self.describe()} has {self.world_size} ranks, {what} {world}")
