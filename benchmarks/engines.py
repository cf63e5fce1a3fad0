"""One routing, six hosts: dist-moe's dispatcher (each dedup mode, and pipelined in 4 chunks),
DeepSpeed's MOELayer, Megatron's alltoall and allgather dispatchers, and Megatron's and DeepSpeed's
MoE layers through dist-moe's dispatcher (``dist_moe_mlp_spec``, ``deepspeed_moe_layer(dispatcher=
"dist_moe")``: rank dedup, node dedup pipelined, and node dedup pipelined with BRANCH limited to
one node per token on tree-prefix placement), on 2 and 4 gloo ranks, side by side.

Every host gets the same router weights (switch, E=8, top-2, no jitter), the same
expert weights and the same tokens; each step is one forward and backward of
(y * w).sum() + aux. Reported per host: median step time (the slowest rank, over
--steps steps after two warm-up steps; hosts take turns step by step so machine
drift hits all alike, and each ratio between hosts is the median of their paired steps' ratios,
printed with the middle half of them), activation memory (bytes of the tensors autograd saves
for backward in one forward: the peak a step holds on top of the weights; CPU
has no allocator high-water mark per module), and bytes each rank sends in the
dispatch direction. DeepSpeed's bytes are capacity-padded (E x C slots; its
payload is the routed copies inside them); Megatron's allgather bytes are every
rank's tokens sent to every other rank (analytic; its splits are not per peer).

    .venv/bin/python benchmarks/engines.py [--steps 10] [--tokens 2048] [--hidden 256] [--ffn 512]
                                           [--precision fp32|bf16] [--wire auto|fp32|bf16|fp8]

``--precision bf16``: every host as bf16 training runs it, the hidden states arriving in bf16 under bf16
autocast (so the engines' own dispatchers send bf16 rows); ``--wire``: the wire dtype of every host
through dist-moe's dispatcher (auto: the dtype the experts compute in).

Beside each host: its link time (its node-crossing bytes as one raw all-to-all, times 4), its
bound max(compute alone, link), where compute alone is dist-moe's layer with every expert on one
rank, nothing exchanged, every rank at once, and its efficiency bound / step; then a per-stage
profile of the fastest dist-moe host and of every engine host through dist-moe's dispatcher.

Under a launcher it runs once on the launched ranks, with the launcher's topology, e.g. across
the emulated cluster's slow link:

    launch/emulate_cluster.sh --nodes 2 --procs-per-node 2 --rate 400mbit benchmarks/engines.py
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

# The engines' notes on what a CPU host lacks (an accelerator, Transformer Engine, Apex) and on their own calls
# of collectives torch deprecates, once per rank and run: not this benchmark's findings. Before the imports
# (every spawned rank imports this file again).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
for note in (r"(Transformer Engine and )?Apex (is|are) not installed", r"full scope is deprecated",
             r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"):
    warnings.filterwarnings("ignore", message=note)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from benchmarks.link_bound import line_rate, line_seconds  # noqa: E402
from benchmarks.paired import ratio_text  # noqa: E402
from benchmarks.stage_profile import print_profiles, stage_profile  # noqa: E402
from dist_moe import MoELayer  # noqa: E402
from dist_moe.config.choices import WIRE_DTYPES  # noqa: E402
from dist_moe.dispatch.contract import CountsBytes  # noqa: E402
from dist_moe.dispatch.exchange import ExchangeConfig  # noqa: E402
from dist_moe.distributed.process_group import launched_world_size  # noqa: E402
from dist_moe.integrations.deepspeed import deepspeed_moe_layer, init_distributed, load_dist_moe_experts  # noqa: E402
from dist_moe.integrations.megatron import load_dist_moe_experts as load_megatron  # noqa: E402
from dist_moe.integrations.megatron import megatron_config, megatron_moe_layer  # noqa: E402
from dist_moe.integrations.megatron import patches as megatron_patches  # noqa: E402
from dist_moe.integrations.megatron.layer import megatron_dist_moe_layer  # noqa: E402
from placement import Placement, Topology  # noqa: E402
from placement.calibrate import replay, slowest  # noqa: E402
from tests.support.dist_utils import run_workers  # noqa: E402

E, K = 8, 2
ROUTER = {"type": "switch", "num_experts": E, "top_k": K, "jitter_eps": 0.0}
BRANCH_LIMITED = {"type": "branch", "num_experts": E, "top_k": K, "subtree_limit": 1}
PIPELINED = 4  # chunks of the pipelined dist-moe hosts
COMPUTE_ALONE = "compute alone:"


def launched() -> bool:
    return launched_world_size() > 1


def _saved_bytes(fn) -> tuple[object, int]:
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def _dispatched(layer):
    """The module that counts dist-moe's dispatcher's bytes in a host, or None (an engine's own)."""
    inner = getattr(layer, "deepspeed_moe", layer)
    return inner if isinstance(inner, CountsBytes) else None


# one pass, each branch one case it handles (complexity above the lint's 15, kept whole)
def worker(rank, world, args, out_path):  # noqa: C901
    megatron_patches.apply()
    from megatron.core import parallel_state  # megatron-core: optional, imported after its patches apply

    torch.set_num_threads(1)
    init_distributed()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    H, F, T = args.hidden, args.ffn, args.tokens
    topo = Topology.from_env() if launched() else Topology(("node", "gpu"), (2, world // 2))
    placement = Placement.contiguous(E, world)
    torch.manual_seed(0)
    hosts = {}
    for dedup, chunks in (("none", 1), ("rank", 1), ("node", 1), ("rank", PIPELINED), ("node", PIPELINED)):
        name = f"dist-moe {dedup}" + (f" C={chunks}" if chunks > 1 else "")
        hosts[name] = MoELayer(H, F, dict(ROUTER), placement=placement, topology=topo, group=dist.group.WORLD,
                               exchange=ExchangeConfig(dedup, chunks, wire_dtype=args.wire))
    ref = hosts["dist-moe rank"]
    for other in hosts.values():
        other.router.load_state_dict(ref.router.state_dict())
        other.experts.load_state_dict(ref.experts.state_dict())
    ds = deepspeed_moe_layer(H, F, dict(ROUTER), ep_size=world, placement=placement)
    ds.set_deepspeed_parallelism()
    ds.deepspeed_moe.gate.router.load_state_dict(ref.router.state_dict())
    load_dist_moe_experts(ds, ref.experts)
    hosts["DeepSpeed MOELayer"] = ds
    for dispatcher in ("alltoall", "allgather"):
        mc = megatron_config(H, F, E, K, world, moe_token_dispatcher_type=dispatcher)
        mg = megatron_moe_layer(mc, dict(ROUTER), placement)
        mg.router.router.load_state_dict(ref.router.state_dict())
        load_megatron(mg, ref.experts)
        hosts[f"Megatron {dispatcher}"] = mg
    # Megatron's MoE layer through dist-moe's dispatcher (dist_moe_mlp_spec): the same router and
    # experts, then BRANCH limited to one node per token on tree-prefix placement (its own weights)
    for dedup, chunks, router, where in (("rank", 1, ROUTER, placement), ("node", PIPELINED, ROUTER, placement),
                                         ("node", PIPELINED, BRANCH_LIMITED, Placement.tree_prefix(E, topo))):
        exchange = ExchangeConfig(dedup, chunks, wire_dtype=args.wire)
        mg = megatron_dist_moe_layer(megatron_config(H, F, E, K, world), dict(router), placement=where, topology=topo,
                                     exchange=exchange)
        if router is ROUTER:
            mg.router.router.load_state_dict(ref.router.state_dict())
            load_megatron(mg, ref.experts)
        label = "BRANCH-limited " if router is BRANCH_LIMITED else ""
        hosts[f"Megatron+dm {label}{dedup}" + (f" C={chunks}" if chunks > 1 else "")] = mg
        # DeepSpeed's MoE module and expert copies through dist-moe's dispatcher, the same three ways
        dsd = deepspeed_moe_layer(H, F, dict(router), ep_size=world, placement=where, topology=topo,
                                  dispatcher="dist_moe", exchange=exchange)
        dsd.set_deepspeed_parallelism()
        if router is ROUTER:
            dsd.deepspeed_moe.gate.router.load_state_dict(ref.router.state_dict())
            load_dist_moe_experts(dsd, ref.experts)
        hosts[f"DeepSpeed+dm {label}{dedup}" + (f" C={chunks}" if chunks > 1 else "")] = dsd

    # compute alone: each router with every expert here, nothing exchanged, all ranks at once (a
    # limit of one node given as its tree depth: two nodes are the tree's two halves)
    for label, router in (("switch", ROUTER), ("BRANCH-limited", dict(BRANCH_LIMITED, subtree_depth=1))):
        hosts[f"{COMPUTE_ALONE} {label}"] = alone = MoELayer(H, F, dict(router))
        if router is ROUTER:
            alone.router.load_state_dict(ref.router.state_dict())
    cross = topo.level_matrix() == 0  # pairs of ranks on different nodes

    g = torch.Generator().manual_seed(rank)
    # hidden states from earlier layers: the input takes a gradient, as inside any model
    bf16 = args.precision == "bf16"
    x = torch.randn(T, H, generator=g).to(torch.bfloat16 if bf16 else torch.float32).requires_grad_()
    w = torch.randn(T, H, generator=g)
    row = H * x.element_size()  # the engines' own dispatchers send the rows as they arrive

    def step(name, layer):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return _step(name, layer)

    def _step(name, layer):
        if isinstance(layer, MoELayer):
            y, aux = layer(x)
        elif name.startswith("DeepSpeed"):
            y, aux, _ = layer(x)
        else:
            y, _ = layer(x.unsqueeze(1))  # Megatron: [S, B, H]; aux rides on its probs
            y, aux = y.squeeze(1), torch.zeros(())
        return (y.float() * w).sum() + aux

    times = {name: [] for name in hosts}
    memory, sent, peers = {}, {}, {}
    for it in range(args.steps + 2):
        for name, layer in hosts.items():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            counted = _dispatched(layer)
            if counted is not None:
                counted.reset_traffic()
            elif name.startswith("DeepSpeed"):
                layer.deepspeed_moe.gate.reset_traffic()
            dist.barrier()
            start = time.perf_counter()
            loss, saved = _saved_bytes(lambda: step(name, layer))
            loss.backward()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if it >= 2:
                times[name].append(float(elapsed))
            memory[name] = saved
            others = torch.arange(world) != rank
            if name.startswith(COMPUTE_ALONE):
                sent[name], peers[name] = (0, None), torch.zeros(world)
            elif counted is not None:
                sent[name] = (int(counted.traffic.matrix.sum()), None)
                peers[name] = counted.traffic.matrix[rank].double()
            elif name.startswith("DeepSpeed"):
                tr = layer.deepspeed_moe.gate.traffic
                sent[name] = (tr["padded_bytes"], tr["payload_bytes"])
                peers[name] = others * tr["padded_bytes"] / (world - 1)  # E x C slots, evenly to every peer
            elif name.endswith("alltoall"):
                splits = torch.tensor([float(n) for n in layer.token_dispatcher.input_splits])
                peers[name] = others * splits * row  # the rows as they arrived
                sent[name] = (int(peers[name].sum()), None)
            else:
                sent[name] = (T * row * (world - 1), None)
                peers[name] = others * float(T * row)
    totals = {}
    for name in hosts:
        mem = torch.tensor([float(memory[name]), float(sent[name][0]), float(sent[name][1] or 0)])
        dist.all_reduce(mem)
        matrix = torch.zeros(world, world, dtype=torch.float64)
        matrix[rank] = peers[name]
        dist.all_reduce(matrix)
        # its node-crossing bytes alone as one raw exchange, or at the emulated link's line rate when it is
        # known; 4: dispatch and combine, forward and backward
        rate = line_rate()
        link = (line_seconds(matrix, topo, rate) if rate
                else 4 * slowest(functools.partial(replay, matrix.round().long(), cross)))
        totals[name] = (statistics.median(times[name]), *(mem / world).tolist(), sent[name][1] is not None, link)
    # where the time of the fastest dist-moe host and of the engines' hosts through dist-moe's dispatcher goes
    fastest = min((n for n in hosts if n.startswith("dist-moe")), key=lambda n: totals[n][0])
    profiled = [fastest] + [n for n in hosts if "+dm" in n]
    totals["profiles"] = {n: stage_profile(lambda n=n: step(n, hosts[n]), 3) for n in profiled}
    totals["steps"] = times  # each host's step times, step by step: the ratios are of paired steps
    megatron_patches.release_parallel_state()  # destroy_model_parallel, and the groups 0.16.1 forgets
    if rank == 0:
        torch.save(totals, out_path)


def report(world: int, totals: dict, args) -> None:
    base = totals["dist-moe rank"]
    where = ", launched" if launched() else ""
    print(f"\n{world} ranks (gloo, CPU{where}), switch E={E} top-{K}, {args.tokens} tokens x hidden {args.hidden} "
          "per rank, "
          f"SwiGLU ffn {args.ffn}, fwd+bwd, median of {args.steps} steps, computing in {args.precision}, "
          f"dist-moe's wire {args.wire}:")
    profiles, steps = totals.pop("profiles"), totals.pop("steps")
    alone = {label: totals[f"{COMPUTE_ALONE} {label}"][0] for label in ("switch", "BRANCH-limited")}
    print(f"{'host':<40}{'step ms':>9}{'vs dist-moe rank':>18}{'saved MB':>10}{'memory ratio':>14}"
          f"{'sent MB/rank':>14}{'payload MB':>12}{'link ms':>9}{'bound ms':>10}{'eff':>6}")
    for name, (t, mem, padded, payload, has_payload, link) in totals.items():
        pay = f"{payload / 2**20:12.2f}" if has_payload else f"{'':>12}"
        bound = max(alone["BRANCH-limited" if "BRANCH" in name else "switch"], link)
        print(f"{name:<40}{1e3 * t:9.1f}{t / base[0]:18.2f}{mem / 2**20:10.2f}{mem / base[1]:14.2f}"
              f"{padded / 2**20:14.2f}{pay}{1e3 * link:9.1f}{1e3 * bound:10.1f}{bound / t:6.2f}")
    print(f"{COMPUTE_ALONE[:-1]}: dist-moe's layer with every expert on this rank, nothing exchanged, every rank "
          "at once; link: each host's node-crossing bytes at the emulated link's shaped rate "
          f"({os.environ.get('DIST_MOE_EMULATED_RATE', 'none here')}), each node's busier direction, or where the "
          "link is not emulated sent as one raw all-to-all in this launch, times 4 (dispatch and combine, forward and "
          "backward); bound = max(compute alone of its router, link); "
          "eff = bound / step")
    ds, mg = steps["DeepSpeed MOELayer"], steps["Megatron alltoall"]
    print("ratios of paired steps (the hosts take turns step by step): their median, and the middle half")
    print(f"dist-moe rank dedup / DeepSpeed = {ratio_text(steps['dist-moe rank'], ds)} (target <= 0.8x); "
          f"/ Megatron alltoall = {ratio_text(steps['dist-moe rank'], mg)} (target <= 1.0x)")
    best = min((n for n in totals if n.startswith("dist-moe")), key=lambda n: totals[n][0])
    print(f"fastest dist-moe host ({best}) / DeepSpeed = {ratio_text(steps[best], ds)}; "
          f"/ Megatron alltoall = {ratio_text(steps[best], mg)}")
    goal = (" (goal, bf16 both sides on the fp8 wire: <= 0.5x across the emulated link)" if args.wire == "fp8" else
            " (goal <= 0.5x across the emulated link, <= 1.0x on loopback)")
    for name in (n for n in totals if n.startswith("Megatron+dm")):
        print(f"{name} / Megatron alltoall (TopKRouter's switch) = {ratio_text(steps[name], mg)}"
              + (goal if "BRANCH" in name else ""))
    for name in (n for n in totals if n.startswith("DeepSpeed+dm")):
        print(f"{name} / DeepSpeed MOELayer (switch) = {ratio_text(steps[name], ds)}"
              + (goal if "BRANCH" in name else ""))
    print_profiles(profiles)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: the hidden states arrive in bf16 and every host runs under bf16 autocast")
    ap.add_argument("--wire", choices=WIRE_DTYPES, default="auto",
                    help="the wire dtype of the hosts through dist-moe's dispatcher")
    args = ap.parse_args()
    if launched():  # one run on the launched ranks

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        out = Path("/tmp") / f"engines_launched_{os.environ.get('MASTER_PORT', '0')}.pt"
        worker(rank, world, args, str(out))
        if rank == 0:
            report(world, torch.load(out, weights_only=True), args)
            out.unlink()
        return
    for world in args.worlds:
        out = Path("/tmp") / f"engines_{world}_{torch.randint(0, 10**9, (1,)).item()}.pt"
        run_workers(worker, world, args=(args, str(out)), timeout=900)
        totals = torch.load(out, weights_only=True)
        out.unlink()
        report(world, totals, args)


if __name__ == "__main__":
    main()
