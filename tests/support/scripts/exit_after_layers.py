"""A user's torchrun script: build MoELayers, run a step, destroy the group, exit with the layers
(and their autograd graphs) still alive; no release_node_groups(). It must exit 0 every time."""
import sys

import torch
import torch.distributed as dist

from dist_moe import MoELayer
from placement import Topology

dedup = sys.argv[1]
dist.init_process_group("gloo")
torch.manual_seed(0)
topo = Topology.from_env()
layers = [MoELayer(16, 32, {"type": "switch", "num_experts": 8, "top_k": 2}, group=dist.group.WORLD,
                   topology=topo, dedup=dedup) for _ in range(2)]
x = torch.randn(32, 16, requires_grad=True)
outputs = []
for layer in layers:
    y, aux = layer(x)
    (y.sum() + aux).backward()
    outputs.append(y)
dist.destroy_process_group()
print("OK", flush=True)
