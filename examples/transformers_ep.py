"""A transformers MoE model trained through dist-moe's dispatcher: the one line is ``dm_hf.use(...)``
before ``from_pretrained``. A tiny random Mixtral stands in for your checkpoint folder.

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/transformers_ep.py
"""
import tempfile

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, MixtralConfig
from transformers.distributed import DistributedConfig

import dist_moe.integrations.transformers as dm_hf
from placement import Topology

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
folder = [tempfile.mkdtemp(prefix="tiny-mixtral-") if rank == 0 else None]
dist.broadcast_object_list(folder)
if rank == 0:  # your model folder instead: config.json and weights
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder[0])
dist.barrier()

dm_hf.use(dedup="node")  # the one line: tokens of every MoE layer through dist-moe's dispatcher
model = AutoModelForCausalLM.from_pretrained(folder[0], distributed_config=DistributedConfig(
    ep_size=world, fsdp_size=world, ep_implementation="dist_moe"))

opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(rank)
for step in range(3):
    ids = torch.randint(0, 128, (4, 32), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f}")
sent = dm_hf.traffic(model)
if rank == 0:
    print(f"rank 0 sent {sum(sent.values())} bytes in forward dispatch over 3 steps, by level: {sent}")
    if Topology.launched(world).sizes[0] == 1:  # torchrun --standalone: every rank on this one machine
        print("node: 0 bytes because these ranks share one node (no byte crosses a node boundary, where node dedup "
              "saves); on 2 nodes: launch/emulate_cluster.sh --nodes 2 --procs-per-node 2 examples/transformers_ep.py")
dist.barrier()
if rank == 0:
    import shutil

    shutil.rmtree(folder[0])
dist.destroy_process_group()
