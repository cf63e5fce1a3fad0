"""Expert parallelism under torchrun: the experts spread over the ranks, tokens exchanged by the
dispatcher, bytes counted per topology level and checked against placement's own accounting.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 4 examples/expert_parallel.py
    (DIST_MOE_TOPOLOGY=node=2,gpu=2 to account 4 local ranks as 2 nodes of 2)
"""
import os

import torch
import torch.distributed as dist

from dist_moe import MoELayerConfig
from dist_moe.dispatch.exchange import ExchangeConfig
from placement import Placement, Topology, Traffic, dispatch_traffic

os.environ.setdefault("DIST_MOE_TOPOLOGY", f"node=2,gpu={int(os.environ['WORLD_SIZE']) // 2}")
dist.init_process_group("gloo")  # under torchrun; "nccl" on GPUs
rank, world = dist.get_rank(), dist.get_world_size()
topo = Topology.from_env()  # node x gpu from the launcher's variables (or DIST_MOE_TOPOLOGY)
torch.manual_seed(0)  # the same router on every rank; each rank's experts draw their own weights
config = MoELayerConfig(64, 256, {"type": "branch", "num_experts": 16, "top_k": 4},
                        exchange=ExchangeConfig(dedup="node"))  # the layer; the cluster comes from the launch
layer = config.build(dist.group.WORLD, Placement.tree_prefix(16, topo), topo)
x = torch.randn(128, 64, generator=torch.Generator().manual_seed(rank))  # this rank's tokens
y, aux = layer(x)
y.square().mean().backward()  # gradients flow back through the exchanges
measured = layer.traffic.matrix  # the bytes this rank sent (its row; a node gateway's forwards included)
analytic = dispatch_traffic(layer.last_routing.expert_idx, rank, layer.placement, topo, 64 * 4, "node").matrix
for m in (measured, analytic):  # summed over ranks the two agree byte for byte
    dist.all_reduce(m)
assert torch.equal(measured, analytic)
if rank == 0:
    by_level = Traffic(measured, topo).by_level()
    print(f"{world} ranks on {topo.describe()}: {by_level} bytes crossed each level (= the analytic count)")
dist.destroy_process_group()
