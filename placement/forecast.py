"""Cost before a cluster exists: bytes per topology level and predicted MoE time per step from a
model's shape, a routing assumption and a topology with link rates (``dist-moe plan``).

No [W, W] matrix is built, so 16,384 GPUs plan in seconds: ``sample`` tokens per rank are
routed by the assumption, grouped into copies by the one dispatch plan (``DispatchPlan``, the
rules the dispatcher executes), and every copy is counted at the level it crosses, read from
its two ranks' coordinates (``DispatchPlan.copies_by_level``). Scaled by tokens_per_rank /
sample, the counts are one exchange's bytes. Time per level is ``placement.cost``'s alpha-beta
time (``LevelCost.seconds`` of ``CostModel.link_load``) on the mean link (every placement here
treats ranks alike, so a sample's maximum would be its noise, not a slow link), with the peers
a rank reaches at a level estimated as N (1 - exp(-c / N)) for c copies over the level's N
candidate ranks. A step of one MoE layer moves four exchanges (dispatch and combine, forward
and backward: the backward sends the same bytes back) and runs its experts' matmuls (SwiGLU:
3 matrices of hidden x ffn, 2 flops a multiply-add, backward twice forward) at the given
TFLOP/s, combined by ``CostModel.layer_time``: blocking exchanges add to the matmuls,
pipelined ones (C chunks) overlap them by the topology's calibrated ``overlap`` share, and
every collective pays its ``latency_s``.
"""
from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass

import torch

from placement.cost import in_range
from placement.names import MAX_EXPERTS, NAMED
from placement.placement import Placement
from placement.plan import DEDUP_MODES, DispatchPlan
from placement.simulate import check_memory
from placement.topology import Topology
from placement.traffic import DTYPE_BYTES, wire_row_bytes

WIRES = ("fp32", "bf16", "fp8")  # what a dispatcher's rows travel in (dist_moe's parallel.wire_dtype)
PLACEMENTS = NAMED  # every named placement, compared side by side
# The most of each shape value: far above any model (hidden sizes are thousands, MoE layers about a
# hundred), and low enough that bytes and seconds stay finite floats whatever the link rates.
MAX_SHAPE = {"hidden": 1 << 20, "ffn": 1 << 20, "experts": MAX_EXPERTS, "top_k": MAX_EXPERTS,
             "tokens_per_rank": 1 << 30, "layers": 10_000}
TFLOPS_RANGE = (1e-3, 1e6)  # achieved TFLOP/s per rank: from a CPU's GFLOP/s to a thousand times a GPU's


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    ffn: int
    experts: int
    top_k: int
    tokens_per_rank: int
    layers: int = 1
    dtype: str = "bf16"

    def __post_init__(self):
        for name, most in MAX_SHAPE.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most:
                raise ValueError(f"--{name.replace('_', '-')} must be an int in [1, {most}], got {reprlib.repr(v)}")
        if self.top_k > self.experts:
            raise ValueError(f"--top-k {self.top_k} is more than --experts {self.experts}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def token_bytes(self) -> int:
        return wire_row_bytes(self.hidden, self.dtype)

    def expert_seconds(self, tflops: float) -> float:
        """Forward + backward of one layer's expert matmuls on one rank."""
        return 3 * 2 * 3 * self.tokens_per_rank * self.top_k * self.hidden * self.ffn / (tflops * 1e12)


def ep_topology(topology: Topology, ep: int) -> Topology:
    """The topology of one expert-parallel group of ``ep`` consecutive ranks, innermost levels
    first: 256 ranks of node=2048,gpu=8 are node=32,gpu=8. The levels it does not span keep
    size 1 (and their link rates). The other groups are its copies."""
    if ep < 1 or topology.world_size % ep:
        raise ValueError(f"--ep {ep} must divide the {topology.world_size} ranks of {topology.describe()}")
    sizes: list = []
    inner = 1
    for name, size in zip(reversed(topology.levels), reversed(topology.sizes)):
        take = min(size, ep // inner)
        if (ep // inner) % take or size % take:
            raise ValueError(f"--ep {ep} does not fill whole {name}s of {topology.describe()}")
        sizes.insert(0, take)
        inner *= take
    return Topology(topology.levels, tuple(sizes), topology.cost)


def uniform_routing(tokens: int, experts: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """[T, K] distinct experts per token, uniformly at random, without a [T, E] tensor."""
    idx = torch.randint(0, experts, (tokens, top_k), generator=generator)
    for _ in range(100):
        s, order = idx.sort(dim=1)
        dup = torch.zeros_like(idx, dtype=torch.bool)
        dup[:, 1:] = s[:, 1:] == s[:, :-1]
        if not bool(dup.any()):
            return idx
        s[dup] = torch.randint(0, experts, (int(dup.sum()),), generator=generator)
        idx = s
    raise ValueError(f"could not draw {top_k} distinct experts of {experts}")


def hop_seconds(per_level: dict, topology: Topology, scale: float, token_bytes: int) -> dict:
    """``CostModel``'s alpha-beta seconds per level for one hop's counts (``DispatchPlan.copies_by_level``),
    scaled to the full batch, on the mean link and the expected peers."""
    out = {}
    cost = topology.cost
    for i, name in enumerate(topology.levels):
        _, sent, recv = per_level[name]
        link = cost.link_load(i, topology, sent * scale * token_bytes, recv * scale * token_bytes)
        candidates = (topology.sizes[i] - 1) * math.prod(topology.sizes[i + 1 :])
        copies = float(sent.double().mean()) * scale
        peers = candidates * (1 - math.exp(-copies / candidates)) if candidates else 0.0
        out[name] = cost.levels[name].seconds(peers, float(link.mean()))
    return out


def forecast(shape: ModelShape, topology: Topology, routing=None, ep: int | None = None, tflops: float = 400.0,
             sample: int | None = None, placements=PLACEMENTS, chunks=(1,)) -> dict:
    """Bytes per token per level and predicted seconds per placement x dedup x pipeline chunks.
    ``routing``: None (uniform), or a callable (tokens, generator) -> [T, K] expert ids (e.g. a
    recorded run's); the ``sample`` tokens are drawn with a fixed seed, so a plan repeats."""
    if ep is not None and (isinstance(ep, bool) or not isinstance(ep, int) or ep < 1):
        raise ValueError(f"--ep must be an int >= 1, got {ep!r}")
    ep = ep if ep is not None else math.gcd(topology.world_size, shape.experts)
    group = ep_topology(topology, ep)
    return {"topology": topology.describe(), "ep_group": group.describe(), "ep": ep,
            "replicas": topology.world_size // ep,
            **group_forecast(shape, group, routing, tflops, sample, placements, chunks)}


def group_forecast(shape: ModelShape, group: Topology, routing=None, tflops: float = 400.0, sample: int | None = None,
                   placements=PLACEMENTS, chunks=(1,)) -> dict:
    """``forecast``'s rows for one expert-parallel group of the topology ``group`` (its own nodes and ranks
    per node; the other groups are its copies)."""
    in_range(tflops, *TFLOPS_RANGE, "--tflops", " (TFLOP/s per rank)")
    ep = group.world_size
    sample = sample if sample is not None else min(shape.tokens_per_rank, max(16, -(-8192 // ep)))
    if sample < 1:
        raise ValueError(f"--sample must be >= 1, got {sample}")
    if shape.experts % ep:
        raise ValueError(f"--experts {shape.experts} do not divide over an EP group of {ep} ranks")
    # about 200 B per sampled (token, expert) pair: ids, sort keys, the plan's copies
    check_memory(ep * sample * shape.top_k * 200, f"planning {ep} ranks x {sample} sampled tokens x top-{shape.top_k}",
                 "lower --sample")
    g = torch.Generator().manual_seed(0)
    t = ep * sample
    idx = routing(t, g) if routing is not None else uniform_routing(t, shape.experts, shape.top_k, g)
    src = torch.arange(ep).repeat_interleave(sample)
    scale = shape.tokens_per_rank / sample
    out: dict = {"token_bytes": shape.token_bytes, "sample_per_rank": sample,
                 "expert_seconds": shape.expert_seconds(tflops), "layers": shape.layers, "rows": []}
    for kind in placements:
        placement = _placement(kind, shape.experts, group)
        if placement is None:
            continue
        for dedup in DEDUP_MODES:
            hops = DispatchPlan.build(idx, placement, group, dedup, src_rank=src).copies_by_level(group)
            bytes_per_token = {name: sum(st[name][0] for st in hops) * shape.token_bytes / t
                               for name in group.levels}
            times = [hop_seconds(st, group, scale, shape.token_bytes) for st in hops]
            # one hop drives every level at once; node dedup's two hops run one after the other
            hop_s = [max(tm.values()) for tm in times]
            exchange = sum(hop_s)
            for c in chunks:
                layer = group.cost.layer_time(hop_s, out["expert_seconds"], c)
                out["rows"].append({"placement": kind, "dedup": dedup, "chunks": c,
                                    "bytes_per_token_by_level": bytes_per_token,
                                    "bytes_per_token_by_wire": {w: {name: v / shape.token_bytes
                                                                    * wire_row_bytes(shape.hidden, w)
                                                                    for name, v in bytes_per_token.items()}
                                                                for w in WIRES},
                                    "exchange_seconds": exchange,
                                    "step_seconds": shape.layers * layer["layer_s"],
                                    # the exchanges' time the experts' matmuls do not hide, per step
                                    "exposed_seconds": shape.layers * (layer["layer_s"] - layer["compute_s"])})
    return out


def _placement(kind: str, experts: int, topology: Topology) -> Placement | None:
    if kind == "tree_prefix" and (experts & (experts - 1) or any(s & (s - 1) for s in topology.sizes)):
        return None  # the tree's subtrees are units only on power-of-two levels
    return Placement.named(kind, experts, topology)

