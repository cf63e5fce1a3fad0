"""Replay recorded routing on a cluster you do not have.

A run records its routing (``RoutingRecord``: the experts each validation token
chose, and the rank it came from). Scaling to W simulated ranks needs at least W
experts, so the recorded expert set is tiled R times (E_sim = R x E, the
smallest multiple of E that is >= W and divisible by W): every simulated token
is a recorded token, drawn with replacement, that lives in replica block r
(uniform per token) and chooses experts ``e + r E``. The co-selection pattern
inside a block is the recorded one, and a block is a contiguous run of expert
ids, so tree prefixes (BRANCH) stay tree prefixes. Each simulated rank sends
``tokens_per_rank`` such tokens; bytes per topology level follow exactly
(``dispatch_traffic``) and times come from the topology's alpha-beta cost model.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from placement.files import read_npz, replacing, write_atomic
from placement.names import MAX_EXPERTS
from placement.placement import Placement, coactivation
from placement.subtree import check_limits, limited_top_k
from placement.topology import Topology
from placement.traffic import DEDUP_MODES, dispatch_traffic

ROUTING_FILE = "routing.npz"


def routing_file(layer: int) -> str:
    return ROUTING_FILE if layer == 0 else f"routing.layer{layer}.npz"


def recorded_layers(run_dir: str | Path) -> int:
    """How many MoE layers a run recorded (0 when it recorded none)."""
    n = 0
    while (Path(run_dir) / routing_file(n)).exists():
        n += 1
    return n


@dataclass
class RoutingRecord:
    expert_idx: torch.Tensor  # [T, K] int64, -1 = dropped
    src_rank: torch.Tensor  # [T] the rank each token started on
    num_experts: int
    world_size: int
    token_bytes: int
    # how the run moved these tokens, when it ran expert-parallel: {"topology": "node=2,gpu=2",
    # "expert_to_rank": [...], "dedup": "node", "measured_bytes_by_level": {level: bytes}}
    dispatch: dict | None = None
    probs: torch.Tensor | None = None  # [T, E] float32, the router's distribution (replays other limits)

    def save(self, run_dir: str | Path, layer: int = 0) -> Path:
        """``routing.npz`` for the first MoE layer, ``routing.layer<i>.npz`` for the others."""
        path = Path(run_dir) / routing_file(layer)
        extra: dict = {} if self.probs is None else {"probs": self.probs.float().cpu().numpy()}
        with replacing(path) as f:
            np.savez(f, expert_idx=self.expert_idx.cpu().numpy(), src_rank=self.src_rank.cpu().numpy(),
                     meta=np.array([self.num_experts, self.world_size, self.token_bytes]), **extra)
        side = path.with_suffix(".json")
        if self.dispatch is not None:
            write_atomic(side, json.dumps(self.dispatch) + "\n")
        elif side.exists():
            side.unlink()
        return path

    @classmethod
    def load(cls, run_dir: str | Path, layer: int = 0) -> RoutingRecord:
        path = Path(run_dir) / routing_file(layer)
        if not Path(run_dir).is_dir():
            raise ValueError(f"run directory {str(run_dir)!r} does not exist" if not Path(run_dir).exists() else
                             f"{str(run_dir)!r} is a file, not a run directory (give the folder dist-moe train wrote)")
        if not path.exists():
            raise ValueError(f"{path} not found: train with dist-moe (it writes {ROUTING_FILE} at the end of a run)")
        arrays = {"expert_idx": ("iu", 2), "src_rank": ("iu", 1), "meta": ("iu", 1), "probs": ("f", 2)}
        z = read_npz(path, arrays, ("expert_idx", "src_rank"), "routing record", optional=("probs",))
        idx, src, meta = z["expert_idx"], z["src_rank"], z["meta"]
        if not len(idx):  # every use divides by the tokens or draws from them
            raise ValueError(f"routing record {path} holds no tokens (0 rows in 'expert_idx'): nothing to measure; "
                             "train with validation data so that the run records its routing")
        if meta.shape != (3,):
            raise ValueError(f"routing record {path}: 'meta' must hold [num_experts, world_size, token_bytes], "
                             f"got {meta.size} values")
        e, w, b = (int(v) for v in meta)
        # every rank of a recorded run held an expert: its world is at most its expert count
        for name, value, top in (("num_experts", e, MAX_EXPERTS), ("world_size", w, MAX_EXPERTS),
                                 ("token_bytes", b, 1 << 30)):
            if not 1 <= value <= top:
                raise ValueError(f"routing record {path}: {name} (in 'meta') must lie in [1, {top}], got {value}")
        bad = [(what, a, lo, hi) for what, a, lo, hi in (("expert_idx", idx, -1, e), ("src_rank", src, 0, w))
               if a.size and (a.min() < lo or a.max() >= hi)]
        if bad:
            what, a, lo, hi = bad[0]
            raise ValueError(f"routing record {path}: {what} holds ids outside [{lo}, {hi}) "
                             f"(min {a.min()}, max {a.max()})")
        if idx.shape[1] > e:
            raise ValueError(f"routing record {path}: {idx.shape[1]} experts per token of {e}")
        probs = z.get("probs")
        if probs is not None:
            _check_probs(path, probs, (len(idx), e))
        return cls(torch.from_numpy(idx).long(), torch.from_numpy(src).long(), e, w, b, _dispatch(path),
                   None if probs is None else torch.from_numpy(probs).float())

    def sample(self, n: int, replicas: int, generator: torch.Generator):
        """``n`` recorded tokens drawn with replacement, each in a uniform replica block of the
        experts tiled ``replicas`` times: (rows drawn, [n, 1] blocks, [n, K] expert ids, -1 dropped)."""
        rows = torch.randint(0, self.expert_idx.shape[0], (n,), generator=generator)
        block = torch.randint(0, replicas, (n, 1), generator=generator)
        chosen = self.expert_idx[rows]
        return rows, block, torch.where(chosen >= 0, chosen + block * self.num_experts, -1)

    def coactivation(self) -> torch.Tensor:
        """[E, E] counts of tokens that selected both experts (diagonal: selections)."""
        e = self.num_experts
        check_memory(4 * (e + 1) * (2 * e + self.expert_idx.shape[0]), f"the co-activation of {e} recorded experts",
                     "record a run with fewer experts")
        return coactivation(self.expert_idx, e)


def _check_probs(path: Path, probs: np.ndarray, shape: tuple) -> None:
    """A record's router distribution: one row per token over every expert, finite and >= 0."""
    if probs.shape != shape:
        raise ValueError(f"routing record {path}: 'probs' must be finite [{shape[0]}, {shape[1]}], got {probs.shape}")
    improper = probs[~(np.isfinite(probs) & (probs >= 0))]
    if len(improper):
        raise ValueError(f"routing record {path}: 'probs' must hold probabilities (finite, >= 0), got "
                         f"{len(improper)} values that are not, such as {improper[0]}")


def _dispatch(routing: Path) -> dict | None:
    """The JSON beside a routing record (how an expert-parallel run moved its tokens), or None."""
    side = routing.with_suffix(".json")
    if not side.exists():
        return None
    if not side.is_file() or side.stat().st_size > 16 << 20:
        raise ValueError(f"routing record {side} is not a file of at most 16 MiB")
    try:
        data = json.loads(side.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"routing record {side} is not valid JSON ({type(e).__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("topology"), str):
        raise ValueError(f"routing record {side} must hold a JSON object with a 'topology' string")
    try:
        Topology.parse(data["topology"])
    except ValueError as e:
        raise ValueError(f"routing record {side}: {e}") from None
    return data


def _no_constant(name: str):
    """Strict JSON: NaN, Infinity and -Infinity are no numbers (and report.json could not hold them)."""
    raise ValueError(f"{name} is not a JSON number")


def replicas_for(num_experts: int, world: int) -> int:
    """Smallest R with R * E >= world and R * E divisible by world."""
    r = max(1, math.ceil(world / num_experts))
    while (r * num_experts) % world:
        r += 1
    return r


def memory_needed(world: int, tokens: int, top_k: int, levels: int) -> int:
    """Bytes ``simulate`` holds at its peak: [W, W] byte, level and cost matrices (about 40 B per
    rank pair with the topology's coordinate cube) and about 80 B per (token, expert) slot."""
    return world * world * (40 + levels) + tokens * top_k * 80


def check_memory(needed: int, what: str, advice: str = "simulate fewer ranks or fewer tokens per rank") -> None:
    """Refuse, before allocating, work that would not fit in half of the memory available now."""
    free = psutil.virtual_memory().available
    if needed > free // 2:
        raise ValueError(f"{what} needs about {needed / 2**30:.1f} GiB, more than half of the "
                         f"{free / 2**30:.1f} GiB available: {advice}")


def replayed_limits(subtree_limit, topology: Topology, num_experts: int, top_k: int, placement: Placement) -> list:
    """A subtree limit (an int: the node level; or {level: M}) as (depth, M) inside one replica block
    of the recorded E experts: a level's units hold E_sim / units experts each, so a block spans
    E / that many units, the subtrees at depth log2(span) of the block's own tree. Refused unless
    every such subtree lies inside one unit of ``placement`` (tree-prefix on power-of-two levels):
    elsewhere the limit would not limit what crosses the level."""
    by_level = subtree_limit if isinstance(subtree_limit, dict) else {
        topology.levels[topology.node_depth - 1]: subtree_limit}
    experts_simulated = placement.num_experts
    ranks = placement.rank_tensor()
    out: dict = {}
    for name, m in by_level.items():
        if name not in topology.levels:
            raise ValueError(f"subtree limit names level {name!r}; the simulated levels are {list(topology.levels)}")
        i = topology.levels.index(name)
        units = math.prod(topology.sizes[: i + 1])
        size = min(num_experts, experts_simulated // units)  # experts of one subtree inside a block
        unit = ranks // math.prod(topology.sizes[i + 1 :])
        if size < 1 or size & (size - 1) or num_experts % size or experts_simulated % units or \
                not bool((unit.reshape(-1, size) == unit.reshape(-1, size)[:, :1]).all()):
            raise ValueError(f"subtree limit {name}={m}: the {units} {name}s of {topology.describe()} under this "
                             f"placement do not hold whole subtrees of the {num_experts}-expert tree (use "
                             "tree_prefix placement and power-of-two level sizes)")
        span = num_experts // size
        depth = span.bit_length() - 1
        out[depth] = min(out.get(depth, m), m, span)
    try:
        return check_limits(sorted(out.items()), num_experts, top_k)
    except ValueError as e:
        raise ValueError(f"subtree limit {subtree_limit!r}: {e}") from None


def _replay(record: RoutingRecord, rows: torch.Tensor, block: torch.Tensor, limits) -> torch.Tensor:
    """The sampled tokens re-selected from their recorded probabilities (top-K, within ``limits``)."""
    if record.probs is None:
        raise ValueError("this run recorded no routing probabilities (it predates them): train it again to "
                         "replay another subtree limit")
    k = record.expert_idx.shape[1]
    probs = record.probs[rows].float()
    idx = limited_top_k(probs, k, limits)[1] if limits else \
        torch.sort(probs, dim=1, descending=True, stable=True).indices[:, :k]
    return idx + block * record.num_experts


def simulate(record: RoutingRecord, topology: Topology, placement_kind: str = "tree_prefix",
             tokens_per_rank: int = 256, seed: int = 0, subtree_limit=None) -> dict:
    """Bytes per level and estimated all-to-all seconds for every dedup mode. With ``subtree_limit``
    the recorded tokens are routed twice from their recorded probabilities, top-K without a limit
    and top-K inside the kept subtrees, and both are reported (``limited`` beside ``modes``)."""
    w = topology.world_size
    check_memory(memory_needed(w, w * tokens_per_rank, record.expert_idx.shape[1], len(topology.sizes)),
                 f"simulating {topology.describe()} ({w} ranks) with {tokens_per_rank} tokens per rank")
    r = replicas_for(record.num_experts, w)
    e_sim = r * record.num_experts
    g = torch.Generator().manual_seed(seed)
    n = w * tokens_per_rank
    rows, block, idx = record.sample(n, r, g)
    src = torch.arange(w).repeat_interleave(tokens_per_rank)
    placement = Placement.named(placement_kind, e_sim, topology)
    out: dict = {"world_size": w, "topology": topology.describe(), "experts_simulated": e_sim, "replicas": r,
           "tokens": n, "placement": placement_kind}
    routings = {"modes": idx}
    if subtree_limit is not None:
        limits = replayed_limits(subtree_limit, topology, record.num_experts, record.expert_idx.shape[1], placement)
        routings = {"modes": _replay(record, rows, block, []), "limited": _replay(record, rows, block, limits)}
        out["subtree_levels"] = limits
    for key, routed in routings.items():
        out[key] = {}
        for dedup in DEDUP_MODES:
            traffic = dispatch_traffic(routed, src, placement, topology, record.token_bytes, dedup)
            levels = traffic.by_level()
            out[key][dedup] = {
                "bytes_by_level": levels,
                "bytes_per_token_by_level": {k: v / n for k, v in levels.items()},
                "estimated_seconds": topology.cost.estimate(traffic, dedup),
                "hop_seconds": topology.cost.hop_seconds(traffic, dedup),
            }
    return out
