"""Plan a cluster you do not have: bytes per topology level and alpha-beta all-to-all time for a
1,024-GPU cluster, per placement and dedup mode, without a process group.

    .venv/bin/python examples/placement_planning.py
"""
import time

import torch

from placement import Placement, Topology, dispatch_traffic

start = time.time()
topo = Topology(("rack", "node", "gpu"), (16, 8, 8))  # 1,024 GPUs
experts, k, tokens = 2048, 8, 20_000
g = torch.Generator().manual_seed(0)
expert_idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])  # random top-8
src_rank = torch.randint(0, topo.world_size, (tokens,), generator=g)
for name, placement in (("contiguous", Placement.contiguous(experts, topo.world_size)),
                        ("tree_prefix", Placement.tree_prefix(experts, topo))):
    for dedup in ("none", "rank", "node"):
        traffic = dispatch_traffic(expert_idx, src_rank, placement, topo, token_bytes=7168 * 2, dedup=dedup)
        per_token = {level: round(b / tokens) for level, b in traffic.by_level().items()}
        print(f"{name:<11} dedup={dedup:<4} B/token {per_token}  est. all-to-all "
              f"{1e3 * topo.cost.estimate(traffic, dedup):.2f} ms")
print(f"planned in {time.time() - start:.1f} s")
