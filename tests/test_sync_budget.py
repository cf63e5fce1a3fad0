"""On a GPU a host read stalls the device pipeline: the expert-parallel layer may block the host
once per exchange in forward (node dedup: twice, one per stage) and never in backward, for every
router and dedup mode, pipelined or not (counted on gloo ranks with the ops that block on CUDA,
tests/sync_budget.py)."""
import pytest

from tests.dist_utils import run_workers

BUDGET = {"none": 1, "rank": 1, "node": 2}


def _budget_worker(rank, world, out):
    import json

    import torch
    import torch.distributed as dist

    from dist_moe import MoELayer
    from placement import Placement, Topology
    from tests.ep_checks import ROUTERS
    from tests.sync_budget import counting

    topo = Topology(("node", "gpu"), (2, world // 2))
    rows = []
    runs = [(name, cfg, dedup, 1) for name, cfg in ROUTERS.items() for dedup in ("none", "rank", "node")]
    runs += [(name, ROUTERS[name], dedup, 3) for name in ("switch", "branch") for dedup in ("none", "rank", "node")]
    for name, cfg, dedup, chunks in runs:
        torch.manual_seed(0)
        layer = MoELayer(8, 12, dict(cfg), topology=topo, placement=Placement.tree_prefix(8, topo),
                         group=dist.group.WORLD, dedup=dedup, capacity_factor=1.25 if name == "switch" else None,
                         shared_expert_hidden=4 if chunks > 1 else 0, pipeline_chunks=chunks)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(13 + 3 * rank, 8, generator=g, requires_grad=True)
        kw = {"categories": torch.randint(0, 5, (x.shape[0],), generator=g)} if name.startswith("specdrop") else {}
        y, aux = layer(x, **kw)  # a first forward and backward: one-time moves of index tensors
        (y.sum() + aux).backward()
        with counting() as forward:
            y, aux = layer(x, **kw)
        with counting() as backward:
            (y.square().sum() + aux).backward()
        rows.append([f"{name} C={chunks}", dedup, forward.total, dict(forward.counts), backward.total,
                     dict(backward.counts)])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


@pytest.mark.parametrize("world", [4])  # 2 x 2: both node-dedup stages
def test_one_host_read_per_exchange_in_forward_none_in_backward(tmp_path, world):
    import json

    out = tmp_path / "syncs.json"
    run_workers(_budget_worker, world, args=(str(out),), timeout=300)
    rows = json.loads(out.read_text())
    print(f"\nhost syncs per layer on {world} ranks (forward / backward):")
    for name, dedup, fwd, fwd_ops, bwd, bwd_ops in rows:
        print(f"  {name:<26} {dedup:<4} {fwd} {fwd_ops} / {bwd} {bwd_ops}")
    over = [(n, d, f, b) for n, d, f, _, b, _ in rows if f > BUDGET[d] or b > 0]
    assert not over, over
