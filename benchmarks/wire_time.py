"""One MoE layer's forward + backward across the emulated link under bf16, its rows on each wire dtype.

    launch/emulate_cluster.sh --nodes 2 --procs-per-node 2 --rate 400mbit benchmarks/wire_time.py [--repeats 9]
                                                                            [--precision bf16|fp32]

4 ranks as 2 nodes x 2, the fine-grained layer (hidden 512, expert ffn 128, 16 experts top-4, 1,024 tokens
per rank, random tokens and untrained routers: the routing's spread, not its quality, sets the bytes), every
arm under bf16 autocast as ``train.precision: bf16`` runs it (``--precision fp32``: the experts in fp32, the
wires named). Two arms: the baseline (Switch, contiguous
placement, no dedup) and BRANCH limited to one node (``subtree_limit: 1``) with tree-prefix placement and
node dedup; each with its rows on an fp32, a bf16 and an fp8 wire, the six taking turns
``--repeats`` times (``paired.py``). Printed: each arm's time per wire and its fp8 / bf16 ratio, BRANCH
limited + node dedup + fp8 against the bf16 baseline, the node-crossing bytes each sent, and the efficiency
max(compute alone, the link time of its bytes) / layer time per wire (the link time: the busiest node's
node-crossing bytes of all four exchanges at the shaped rate; fp8's dispatch at its packed rows, the other
three in bf16).

Goals: each link-bound arm's fp8 time at most 0.6x its bf16 wire's; BRANCH limited + node dedup + fp8 at
most 0.5x the bf16 baseline's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.link_bound import line_rate, line_seconds  # noqa: E402
from benchmarks.paired import interleaved, ratio_text  # noqa: E402
from dist_moe import MoELayer  # noqa: E402
from dist_moe.distributed.process_group import init_from_env, shutdown  # noqa: E402
from placement import Placement, Topology, Traffic, wire_row_bytes  # noqa: E402

H, F, E, K, T = 512, 128, 16, 4, 1024
ARMS = {"baseline (switch, contiguous, no dedup)": ({"type": "switch", "num_experts": E, "top_k": K,
                                                     "jitter_eps": 0.0}, "contiguous", "none"),
        "BRANCH limited, tree-prefix, node dedup": ({"type": "branch", "num_experts": E, "top_k": K,
                                                     "subtree_limit": 1, "subtree_depth": 1}, "tree_prefix", "node")}
WIRES = ("fp32", "bf16", "fp8")


def under(precision: str, fn):
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            return fn()
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                    help="what the layer computes in (fp32: the wires named, the experts in fp32: on a CPU, whose bf16 "
                         "matmuls are slow, the regime where the link sets the time)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    init_from_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_env() if world == 4 else Topology(("node", "gpu"), (1, world))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    steps, layers = {}, {}
    for arm, (cfg, placement, dedup) in ARMS.items():
        for wire in WIRES:
            torch.manual_seed(0)
            where = Placement.tree_prefix(E, topo) if placement == "tree_prefix" else Placement.contiguous(E, world)
            layer = MoELayer(H, F, dict(cfg), placement=where, topology=topo, group=dist.group.WORLD, dedup=dedup,
                             capacity_factor=None, wire_dtype=wire)
            layers[arm, wire] = layer

            def step(layer=layer):
                y, aux = layer(x)
                (y.float().square().mean() + aux).backward()

            steps[f"{arm} | {wire}"] = under(args.precision, step)
    torch.manual_seed(0)
    alone = {arm: MoELayer(H, F, dict(cfg)) for arm, (cfg, _, _) in ARMS.items()}  # every expert here

    def compute(arm):
        y, aux = alone[arm](x)
        (y.float().square().mean() + aux).backward()

    for arm in ARMS:
        steps[f"{arm} | compute alone"] = under(args.precision, lambda arm=arm: compute(arm))
    times = interleaved(steps, args.repeats)
    rate = line_rate()
    sent = {}
    for key, layer in layers.items():  # one more forward each, its bytes counted on every rank
        layer.reset_traffic()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            layer(x.detach())
        matrix = layer.traffic.matrix.clone()
        dist.all_reduce(matrix)
        sent[key] = matrix
    if rank == 0:
        node = topo.levels[0]
        print(f"{world} ranks on {topo.describe()}, link {'%.0f MB/s' % (rate / 1e6) if rate else 'not shaped'}; "
              f"hidden {H}, ffn {F}, {E} experts top-{K}, {T} tokens per rank, computing in {args.precision}; "
              f"median of {args.repeats} turns each")
        print(f"{'arm':<42}{'wire':>6}{'ms':>9}{node + ' MB':>10}{'efficiency':>12}")
        for arm in ARMS:
            alone_s = statistics.median(times[f"{arm} | compute alone"])
            for wire in WIRES:
                layer_s = statistics.median(times[f"{arm} | {wire}"])
                matrix = sent[arm, wire]
                by_level = Traffic(matrix, topo).by_level()
                efficiency = ""
                if rate:
                    other = wire_row_bytes(H, "bf16" if wire == "fp8" else wire) / wire_row_bytes(H, wire)
                    link = line_seconds(matrix, topo, rate) * (1 + 3 * other) / 4
                    efficiency = f"{max(alone_s, link) / layer_s:.2f}"
                print(f"{arm:<42}{wire:>6}{1e3 * layer_s:>9.1f}{by_level[node] / 1e6:>10.2f}{efficiency:>12}")
            print(f"  fp8 / bf16 wire: {ratio_text(times[f'{arm} | fp8'], times[f'{arm} | bf16'])}; "
                  f"compute alone {1e3 * alone_s:.1f} ms")
        base, limited = list(ARMS)
        print(f"BRANCH limited + node dedup + fp8 / baseline on a bf16 wire: "
              f"{ratio_text(times[f'{limited} | fp8'], times[f'{base} | bf16'])} (goal <= 0.5x)")
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
