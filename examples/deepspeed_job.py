"""A DeepSpeed job, driven by its ds_config, whose MoE gate is dist-moe's.

    .venv/bin/deepspeed --num_gpus 2 examples/deepspeed_job.py --zero 1
    (or: .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 examples/deepspeed_job.py)

A user's model with ``deepspeed.moe.layer.MoE`` (the user's own expert module, 4 experts over
the ranks, top-1, dropless) trained by ``deepspeed.initialize`` with ZeRO stage 0, 1 or 2.
It is built three times from one seed: with DeepSpeed's TopKGate; with ``DistMoEGate(switch)``
assigned to ``moe.deepspeed_moe.gate`` (its weights copied from the first); and with that gate
and ``use_dist_moe_dispatcher(moe)``, so dist-moe's dropless dispatcher moves the tokens instead
of DeepSpeed's capacity-padded all-to-all. The training loop is DeepSpeed's own: ``loss = task +
coeff * l_aux`` with the gate's unscaled l_aux, and all three train to the same losses step for
step. The last one is saved with ``save_checkpoint`` and loaded into a fresh engine whose
weights were moved away: it comes back exactly.
"""
import argparse
import shutil
import tempfile

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

from dist_moe.integrations.deepspeed import DistMoEGate, init_distributed, shutdown_distributed
from dist_moe.integrations.deepspeed.dispatch import use_dist_moe_dispatcher

HIDDEN, EXPERTS, STEPS, BATCH, AUX = 16, 4, 5, 32, 0.01


class Expert(torch.nn.Module):  # the user's own expert: DeepSpeed copies it into every slot
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(HIDDEN, 32), torch.nn.Linear(32, HIDDEN)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Net(torch.nn.Module):
    def __init__(self, world: int, host: str):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, HIDDEN)
        self.moe = MoE(HIDDEN, Expert(), num_experts=EXPERTS, ep_size=world, k=1, drop_tokens=False)
        self.head = torch.nn.Linear(HIDDEN, 1)
        if host != "TopKGate":  # the one change a DeepSpeed user makes
            theirs = self.moe.deepspeed_moe.gate.wg.weight.detach().clone()
            self.moe.deepspeed_moe.gate = DistMoEGate({"type": "switch", "num_experts": EXPERTS, "top_k": 1,
                                                      "jitter_eps": 0.0, "aux_loss_coeff": AUX}, HIDDEN, world)
            with torch.no_grad():
                self.moe.deepspeed_moe.gate.router.node_map.weight.copy_(theirs)
        if host == "dist_moe dispatcher":  # and the second: dist-moe's dispatcher moves the tokens
            use_dist_moe_dispatcher(self.moe, dedup="rank")

    def forward(self, x):
        h, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        return self.head(h).squeeze(-1), l_aux


def initialize(net, zero: int):
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()),
                                                                   "name": "parameters"})
    ds_config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": zero}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.Adam(groups, lr=1e-2), config=ds_config)
    return engine


def train(engine, world: int, rank: int) -> list[float]:
    g = torch.Generator().manual_seed(10 + rank)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, generator=g)
        pred, l_aux = engine(x)
        loss = torch.nn.functional.mse_loss(pred, y) + AUX * l_aux  # DeepSpeed's convention
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zero", type=int, default=0, choices=(0, 1, 2))
    ap.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
    args = ap.parse_args()
    init_distributed()  # DeepSpeed's process group (gloo on CPU, NCCL with CUDA)
    world, rank = dist.get_world_size(), dist.get_rank()
    hosts = ("TopKGate", "DistMoEGate", "dist_moe dispatcher")
    engines = {host: initialize(Net(world, host), args.zero) for host in hosts}
    losses = {host: train(engine, world, rank) for host, engine in engines.items()}
    if rank == 0:
        for step, (a, b, c) in enumerate(zip(*losses.values())):
            print(f"step {step}: loss TopKGate {a:.6f} DistMoEGate {b:.6f} dist_moe_dispatcher {c:.6f}")
    folder = [tempfile.mkdtemp(prefix="deepspeed-job-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)  # one checkpoint folder for every rank
    trained = engines["dist_moe dispatcher"]
    trained.save_checkpoint(folder[0], tag="end")
    fresh = initialize(Net(world, "dist_moe dispatcher"), args.zero)
    with torch.no_grad():
        for p in fresh.module.parameters():
            p.add_(1.0)  # away from the saved weights: what is not loaded shows
    fresh.load_checkpoint(folder[0], tag="end")
    saved = dict(trained.module.named_parameters())
    exact = torch.tensor(float(all(torch.equal(p, saved[n]) for n, p in fresh.module.named_parameters())))
    dist.all_reduce(exact, op=dist.ReduceOp.MIN)  # every rank's own experts and shards
    if rank == 0:
        print(f"save_checkpoint / load_checkpoint (dist_moe dispatcher, ZeRO {args.zero}): "
              f"{'exact' if exact else 'DIFFERENT'}")
        shutil.rmtree(folder[0])  # every rank has loaded (the all-reduce above)
    shutdown_distributed()  # DeepSpeed's groups released with the process group, none left for exit


if __name__ == "__main__":
    main()
