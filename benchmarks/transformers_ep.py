"""transformers' expert parallelism through dist-moe's dispatcher against its own ``all_to_all``: a small
DeepSeek-V3 (group-limited routing, one group per node, each token's experts on one node), step time
(forward + backward, the slowest rank) and node-crossing bytes, as ratios measured side by side.

Every rank loads the same checkpoint once per arm (``DistributedConfig(ep_size=W, fsdp_size=W,
ep_implementation=...)``); the arms then run interleaved, one step each per round, each round
starting at the next arm, and each arm's time is divided by ``all_to_all``'s of the same round: the
median of those ratios is printed with its quartiles. Bytes: what dist-moe's layers measured
(``dist_moe.integrations.transformers.traffic``), and for ``all_to_all`` (one copy per token and
expert) ``placement.dispatch_traffic`` of the routings its layers were given, summed over ranks.

    launch/emulate_cluster.sh --nodes 2 --procs-per-node 2 --rate 400mbit benchmarks/transformers_ep.py
    DIST_MOE_TOPOLOGY=node=2,gpu=2 .venv/bin/torchrun --nproc-per-node 4 benchmarks/transformers_ep.py  # loopback
"""
from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dist_moe.integrations.transformers as dm_hf  # noqa: E402
from dist_moe.distributed.process_group import shutdown  # noqa: E402
from placement import Placement, Topology, dispatch_traffic  # noqa: E402

EXPERTS, TOP_K, HIDDEN, FFN, VOCAB = 16, 4, 256, 128, 256
# (label, ep_implementation, dedup, chunks); the first is the reference
ARMS = [("all_to_all", "counted_all_to_all", None, 1), ("dist_moe none C=1", "dist_moe", "none", 1),
        ("dist_moe rank C=1", "dist_moe", "rank", 1), ("dist_moe node C=1", "dist_moe", "node", 1),
        ("dist_moe node C=2", "dist_moe", "node", 2), ("dist_moe node C=4", "dist_moe", "node", 4)]


def config(nodes: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                            moe_intermediate_size=FFN, num_hidden_layers=3, first_k_dense_replace=1,
                            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, n_group=nodes, topk_group=1, n_shared_experts=1,
                            kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                            v_head_dim=32, max_position_embeddings=512, tie_word_embeddings=False)


def register_counted_all_to_all():
    """transformers' ``all_to_all``, recording the routings it was given (for its bytes)."""
    from transformers.distributed.expert_parallel import AllToAllEP, EPImplementationInterface

    class CountedAllToAll(AllToAllEP):
        instances = []  # one per MoE layer of the one model loaded with it

        def __init__(self, *args):
            super().__init__(*args)
            self.calls = []
            CountedAllToAll.instances.append(self)

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            self.calls.append((top_k_index.detach().clone(), hidden_states.shape[1] * hidden_states.element_size()))
            return super().__call__(hidden_states, top_k_index, top_k_weights)

    EPImplementationInterface.register("counted_all_to_all", CountedAllToAll)
    return CountedAllToAll


def load(path, world: int, implementation: str):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    return AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(ep_size=world, fsdp_size=world, ep_implementation=implementation))


def node_bytes(model, counted, topology: Topology) -> int:
    """Node-crossing forward-dispatch bytes of every rank, this run."""
    world, rank = topology.world_size, dist.get_rank()
    if counted is None:
        mine = dm_hf.traffic(model)[topology.levels[0]]
    else:
        layout = Placement.contiguous(EXPERTS, world)
        mine = sum(dispatch_traffic(idx, rank, layout, topology, width, "none").by_level()[topology.levels[0]]
                   for layer in counted.instances for idx, width in layer.calls)
    total = torch.tensor([mine])
    dist.all_reduce(total)
    return int(total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank per step (batch 2 x tokens/2)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    failed = True
    try:
        measure(a.rounds, a.tokens)
        failed = False
    finally:
        shutdown(wait=not failed)


def measure(rounds: int, tokens: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = Topology.launched(world)
    counted = register_counted_all_to_all()
    folder = [tempfile.mkdtemp(prefix="dist-moe-hf-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    path = Path(folder[0]) / "deepseek_v3"
    if rank == 0:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config(topology.num_nodes)).save_pretrained(path)
    dist.barrier()
    models, steps = {}, {}
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, VOCAB, (2, tokens // 2), generator=g)
    for label, implementation, dedup, chunks in ARMS:
        if dedup is not None:
            dm_hf.use(dedup=dedup, pipeline_chunks=chunks)
        model = load(path, world, implementation)
        models[label] = model

        def step(model=model):
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        step()  # warm-up
        steps[label] = step
    dist.barrier()  # every rank has loaded every arm: the checkpoint can go
    if rank == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    for label, model in models.items():  # the bytes of one step each, from here on
        if label == ARMS[0][0]:
            for layer in counted.instances:
                layer.calls = []
        else:
            dm_hf.reset_traffic(model)
    times = {label: [] for label in steps}
    labels = list(steps)
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[: r % len(labels)]:
            dist.barrier()
            start = time.perf_counter()
            steps[label]()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
            times[label].append(float(elapsed))
    moved = {label: node_bytes(model, counted if label == ARMS[0][0] else None, topology) / rounds
             for label, model in models.items()}
    if rank == 0:
        ref = ARMS[0][0]
        print(f"DeepSeek-V3 tiny (hidden {HIDDEN}, {EXPERTS} experts top-{TOP_K}, n_group={topology.num_nodes} "
              f"topk_group=1, 2 MoE layers), {tokens} tokens per rank, {topology.describe()}, {rounds} rounds")
        print(f"{'arm':<22}{'step ms':>9}  {'vs all_to_all':<22}{'node bytes/step':>16}{'vs all_to_all':>14}")
        for label in labels:
            ratios = [t / b for t, b in zip(times[label], times[ref])]
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            print(f"{label:<22}{1e3 * statistics.median(times[label]):>9.1f}  {statistics.median(ratios):.2f}x "
                  f"[{q1:.2f}, {q3:.2f}]{'':<5}{moved[label]:>16,.0f}{moved[label] / max(moved[ref], 1):>13.2f}x")


if __name__ == "__main__":
    main()
