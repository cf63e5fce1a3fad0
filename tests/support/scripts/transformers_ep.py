"""Run by torchrun (tests/integrations/test_transformers_ep.py): tiny transformers MoE models trained through
``ep_implementation="dist_moe"`` against transformers' ``all_to_all``, every rank checking its own.

    torchrun --nproc-per-node W tests/support/scripts/transformers_ep.py FOLDER TOPOLOGY [save]
"""
from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from placement import Topology  # noqa: E402
from tests.support.hf_models import config  # noqa: E402  (the repository root first)

STEPS, BATCH, SEQ, VOCAB, EXPERTS = 2, 2, 8, 64, 8
MODELS = ("mixtral", "qwen3_moe", "deepseek_v3")


def _save_models(folder, nodes: int) -> None:
    from transformers import AutoModelForCausalLM

    for kind in MODELS:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config(kind, VOCAB, nodes, router_loss=False)).save_pretrained(folder / kind)


def _load(path, world, implementation, ep=None):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(ep_size=ep or world, fsdp_size=world, ep_implementation=implementation)
    return AutoModelForCausalLM.from_pretrained(path, distributed_config=config)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _train(model, rank):
    """Per step this rank's loss (its own tokens), and the first step's gradients by name (local shards)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    losses, first = [], {}
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            first = {n: _local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, first


def _case(rank, world, folder, topology_spec, kind, cases):
    """One model: the reference run, then every (dedup, chunks) through dist-moe."""
    import dist_moe.integrations.transformers as dm_hf
    from placement import Topology, Traffic

    topology = Topology.parse(topology_spec)
    path = folder / kind
    want_losses, want_grads = _train(_load(path, world, "all_to_all"), rank)
    node_bytes = {}
    for dedup, chunks in cases:
        dm_hf.use(dedup=dedup, pipeline_chunks=chunks, topology=topology)
        model = _load(path, world, "dist_moe")
        dm_hf.reset_traffic(model)
        routings = _recorded(model)
        losses, grads = _train(model, rank)
        where = f"rank {rank}, {kind}, dedup={dedup}, chunks={chunks}"
        assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(losses, want_losses)), \
            f"{where}: losses {losses} != {want_losses}"
        assert grads.keys() == want_grads.keys(), where
        for name, grad in grads.items():
            assert torch.allclose(grad, want_grads[name], atol=1e-6, rtol=1e-5), f"{where}: {name}"
        want = _expected_bytes(model, routings, topology, dedup)
        got = dm_hf.traffic(model)
        mine = want.clone()
        mine[torch.arange(world) != rank] = 0  # this rank's row: what it sent (a gateway's forwards included)
        assert got == Traffic(mine, topology).by_level(), f"{where}: measured {got}, dispatch_traffic {mine[rank]}"
        node_bytes[dedup] = got[topology.levels[0]] if topology.num_nodes > 1 else None
        if (dedup, chunks) == cases[-1]:
            _round_trip(model, folder, world, rank, kind)
    if topology.num_nodes > 1:
        assert node_bytes["node"] < node_bytes["none"], f"rank {rank}, {kind}: {node_bytes}"


def _smaller_mesh(rank, world, folder):
    """EP 2 of the 4 ranks, the experts' replicas FSDP-sharded over the other dimension: dist-moe's layer sees
    the launch's topology over its mesh's own ranks (DIST_MOE_TOPOLOGY node=4,gpu=1: 2 nodes of 1), so node
    dedup crosses the mesh's node boundary; losses and gradients equal transformers' all_to_all's."""
    import dist_moe.integrations.transformers as dm_hf

    path = folder / "mixtral"
    want_losses, want_grads = _train(_load(path, world, "all_to_all", ep=2), rank)
    dm_hf.use(dedup="node", pipeline_chunks=1)
    model = _load(path, world, "dist_moe", ep=2)
    losses, grads = _train(model, rank)
    layers = [m._dist_moe_ep for m in model.modules() if hasattr(m, "_dist_moe_ep")]
    assert layers and all(ep.topology.describe() == "node=2,gpu=1" for ep in layers), rank
    assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(losses, want_losses)), (rank, losses, want_losses)
    assert grads.keys() == want_grads.keys(), rank
    for name, grad in grads.items():
        assert torch.allclose(grad, want_grads[name], atol=1e-6, rtol=1e-5), f"rank {rank}, EP 2 of 4: {name}"


def _expected_bytes(model, routings, topology, dedup):
    """[W, W]: ``dispatch_traffic`` of every rank's routings (each layer, each forward), summed, which
    every rank's measured rows must make up together."""
    from dist_moe.distributed.reductions import all_gather_rows
    from placement import dispatch_traffic

    rank, world = dist.get_rank(), dist.get_world_size()
    layers = [m._dist_moe_ep for m in model.modules() if hasattr(m, "_dist_moe_ep")]
    want = torch.zeros(world, world, dtype=torch.long)
    measured = torch.zeros(world, world, dtype=torch.long)
    for layer, layer_routings in zip(layers, routings):
        measured += layer.dispatcher.traffic
        for idx, width in layer_routings:
            src = all_gather_rows(torch.full((idx.shape[0],), rank, dtype=torch.long), dist.group.WORLD)
            want += dispatch_traffic(all_gather_rows(idx, dist.group.WORLD), src, layer.placement, topology, width,
                                     dedup).matrix
    dist.all_reduce(measured)
    assert torch.equal(measured, want), (rank, dedup, measured, want)
    return want


def _recorded(model):
    """[per dist-moe layer: [(top-k index, row bytes) per forward]]: what each layer's dispatcher was given."""
    out = []
    for m in model.modules():
        ep = getattr(m, "_dist_moe_ep", None)
        if ep is not None:
            ep.dispatcher = _Recording(ep.dispatcher)
            out.append(ep.dispatcher.calls)
    return out


class _Recording:
    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def dispatch(self, tokens, routing, *args, **kwargs):
        h = tokens.h
        self.calls.append((routing.expert_idx.detach().clone(), h.shape[1] * h.element_size()))
        return self.inner.dispatch(tokens, routing, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _round_trip(model, folder, world, rank, kind):
    """save_pretrained (every rank, collectively) then from_pretrained: the same weights, shard by shard."""
    out = folder / f"{kind}-saved-{world}"
    model.save_pretrained(out)
    dist.barrier()
    again = _load(out, world, "dist_moe")
    want = {n: _local(p.detach()) for n, p in model.named_parameters()}
    for name, p in again.named_parameters():
        assert torch.equal(_local(p.detach()), want[name]), f"rank {rank}, {kind}: {name} after the round trip"



def main() -> None:
    folder, topology_spec = Path(sys.argv[1]), sys.argv[2]
    if sys.argv[3:] == ["save"]:  # one process, before the launch
        _save_models(folder, int(topology_spec.split(",")[0].split("=")[1]))
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    # every dedup and chunk count on 2 nodes x 2; on one node (node dedup is rank dedup there) expert
    # parallelism of 2 ranks, pipelined, for every model
    two_nodes = Topology.parse(topology_spec).num_nodes > 1
    cases = [(dedup, chunks) for dedup in ("none", "rank", "node") for chunks in (1, 3)] if two_nodes else [("rank", 3)]
    for kind in MODELS:
        _case(rank, world, folder, topology_spec, kind, cases)
    if world == 4:
        _smaller_mesh(rank, world, folder)
    dist.barrier()
    print(f"OK rank {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
