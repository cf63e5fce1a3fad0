"""Pipelined exchanges (``pipeline_chunks`` C > 1) compute what C = 1 computes: outputs, input,
gate (router), expert and shared-expert gradients (fp32, atol 1e-6), bytes and metadata bytes,
for every router, dedup mode and placement on 2 and 4 ranks, with a rank that has no tokens and
chunks that are empty; and every rank issues the same collectives."""
import pytest

from tests.support.dist_utils import run_workers

CHUNKS = 3
TOKENS = {2: [2, 11], 4: [0, 2, 13, 5]}  # an empty rank; ranks with fewer tokens than chunks


def _grads(layer) -> dict:
    return {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def _pipeline_worker(rank, world, out):
    import datetime
    import json

    import torch
    import torch.distributed as dist

    from dist_moe import MoELayer
    from placement import Placement, Topology
    from tests.support.ep_checks import ROUTERS, shuffled_placement

    calls = []
    original = dist.all_to_all_single

    def counted(*args, **kwargs):  # the collectives this rank issues, in order, with their group
        calls.append(id(kwargs.get("group")))
        return original(*args, **kwargs)

    dist.all_to_all_single = counted
    topo = Topology(("node", "gpu"), (2, world // 2))
    placements = {"shuffled": shuffled_placement(world, 5)}
    if world == 4:  # on 2 x 1 tree-prefix placement is contiguous
        placements["tree_prefix"] = Placement.tree_prefix(8, topo)
    g = torch.Generator().manual_seed(rank)
    n = TOKENS[world][rank]
    x0, w = torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)
    cats = torch.randint(0, 5, (n,), generator=g)
    failures, issued = [], []
    for name, cfg in ROUTERS.items():
        for dedup in ("none", "rank", "node"):
            for pname, placement in placements.items():
                results = []
                for chunks in (1, CHUNKS):
                    torch.manual_seed(0)
                    layer = MoELayer(8, 12, dict(cfg), topology=topo, placement=placement, group=dist.group.WORLD,
                                     dedup=dedup, shared_expert_hidden=6, pipeline_chunks=chunks,
                                     capacity_factor=1.25 if name == "switch" else None,
                                     timeout=datetime.timedelta(seconds=60))
                    x = x0.clone().requires_grad_()
                    torch.manual_seed(1)  # the same draws for routers that sample
                    calls.clear()
                    y, _ = layer(x, categories=cats, token_ids=torch.arange(n) * 7919)
                    (y * w).sum().backward()
                    issued.append(len(calls))
                    results.append((y.detach(), x.grad.clone(), _grads(layer), layer.traffic.matrix.clone(),
                                    layer.metadata_bytes))
                (y1, gx1, gp1, t1, m1), (yc, gxc, gpc, tc, mc) = results
                same = torch.allclose(y1, yc, atol=1e-6) and torch.allclose(gx1, gxc, atol=1e-6) \
                    and gp1.keys() == gpc.keys() and all(torch.allclose(gp1[k], gpc[k], atol=1e-6) for k in gp1) \
                    and torch.equal(t1, tc) and m1 == mc
                if not same:
                    failures.append(f"{name}/{dedup}/{pname} on rank {rank}")
    # every rank issued as many collectives, per layer call, as every other
    counts = torch.tensor(issued)
    everyone = [torch.zeros_like(counts) for _ in range(world)]
    original_gather = dist.all_gather
    original_gather(everyone, counts)
    lists = [None] * world
    dist.all_gather_object(lists, failures)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"failures": sum(lists, []), "issued": [c.tolist() for c in everyone]}, f)


@pytest.mark.parametrize("world", [2, 4])
def test_pipelined_layer_equals_one_chunk(tmp_path, world):
    import json

    out = tmp_path / "pipeline.json"
    run_workers(_pipeline_worker, world, args=(str(out),), timeout=300)
    result = json.loads(out.read_text())
    assert result["failures"] == []
    issued = result["issued"]
    assert all(row == issued[0] for row in issued), "ranks issued different numbers of collectives"


def _collectives_worker(rank, world, out):
    import torch
    import torch.distributed as dist

    from benchmarks.collectives import ROUTER, count_collectives
    from dist_moe import MoELayer
    from placement import Placement, Topology

    two_nodes, one_node, one_rank_each = (Topology(("node", "gpu"), sizes) for sizes in ((2, 2), (1, 4), (4, 1)))
    depth = 4  # E=16
    # node dedup runs two stages only where a node boundary and a node's ranks both exist
    cases = [(two_nodes, "rank", 1, 1), (two_nodes, "rank", 4, 1), (two_nodes, "node", 1, 2),
             (two_nodes, "node", 3, 2), (one_node, "node", 3, 1), (one_rank_each, "node", 1, 1)]
    for topology, dedup, chunks, stages in cases:
        layer = MoELayer(8, 8, ROUTER, placement=Placement.tree_prefix(16, topology), topology=topology,
                         group=dist.group.WORLD, dedup=dedup, pipeline_chunks=chunks)
        x = torch.randn(40 + 7 * rank, 8, requires_grad=True)  # every rank a different token count
        layer(x)
        fwd = count_collectives(lambda: layer(x))
        both = count_collectives(lambda: layer(x)[0].square().sum().backward())
        balance = 0 if topology is one_node else 1  # a limit of the one node limits nothing: no balance
        # per stage: split sizes, every chunk's metadata, then each chunk's payload out and back;
        # backward: each chunk's gradients out and back, every chunk's gate gradients at once
        assert fwd["all_to_all_single"] == stages * (2 + 2 * chunks), (rank, dedup, chunks, fwd)
        assert both["all_to_all_single"] - fwd["all_to_all_single"] == stages * (2 * chunks + 1), (rank, both)
        # BRANCH: one sum per depth forward, one for every depth's gradient, one for the balance's loads
        assert both["all_reduce"] == depth + 1 + balance, (rank, dedup, chunks, both)


def test_collectives_per_layer_forward_and_backward(tmp_path):
    run_workers(_collectives_worker, 4, args=(str(tmp_path),), timeout=180)
