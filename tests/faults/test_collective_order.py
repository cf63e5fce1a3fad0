"""A rank's bad input, or a rank that skipped a forward, stops every rank together: no batch of one
rank is ever paired with another batch of its peers (Python API, exceptions caught and ignored)."""
import pytest

from tests.support.dist_utils import run_workers

H, E = 8, 8


def _layer(router: dict, dedup: str):
    import torch
    import torch.distributed as dist

    from dist_moe import MoELayer
    from placement import Placement, Topology

    torch.manual_seed(0)
    topo = Topology(("node", "gpu"), (2, dist.get_world_size() // 2))
    return MoELayer(H, 16, dict(router), placement=Placement.tree_prefix(E, topo), topology=topo,
                    group=dist.group.WORLD, dedup=dedup)


def _caught(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - what a careless caller does
        return e
    return None


def _bad_input_worker(rank, world, router, dedup):
    import torch

    from dist_moe.dispatch.agree import InputRejected

    layer = _layer(router, dedup)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randn(12, H, generator=g) for _ in range(3)]
    cats = [torch.randint(0, 5, (12,), generator=g) for _ in range(3)]
    bad = batches[1].clone()
    if rank == 1:
        if router["type"] == "specdrop":
            cats[1] = cats[1].clone()
            cats[1][3] = 9  # out of range for num_categories=5
        else:
            bad[4, 2] = float("nan")
    kwargs = [{"categories": c} if router["type"] == "specdrop" else {} for c in cats]
    y0, _ = layer(batches[0], **kwargs[0])
    state = {k: v.clone() for k, v in layer.router.state_dict().items()}
    err = _caught(lambda: layer(bad, **kwargs[1]))
    assert isinstance(err, InputRejected), f"rank {rank}: {err!r}"  # on every rank, not only the bad one
    assert "rank 1 of the expert-parallel group" in str(err)
    for k, v in layer.router.state_dict().items():  # the refused forward left no trace
        assert torch.equal(v, state[k]), k
    # the next batch pairs with the next batch: the same output as a fresh run of batch 2 would give
    y2, _ = layer(batches[2], **kwargs[2])
    fresh = _layer(router, dedup)
    fresh.load_state_dict(layer.state_dict())
    y2_again, _ = fresh(batches[2], **kwargs[2])
    assert torch.allclose(y2, y2_again, atol=1e-6)


@pytest.mark.parametrize("router,dedup", [
    ({"type": "switch", "num_experts": E, "top_k": 2, "jitter_eps": 0.0}, "rank"),
    ({"type": "deepseek_v3", "num_experts": E, "top_k": 2}, "node"),
    ({"type": "specdrop", "num_experts": E, "num_categories": 5, "p_assigned": 0.7}, "rank"),
])
def test_one_ranks_bad_input_stops_every_rank_at_the_same_exchange(router, dedup):
    run_workers(_bad_input_worker, 2, args=(router, dedup), timeout=120)


def _skipped_forward_worker(rank, world):
    import torch

    from dist_moe.dispatch.agree import OutOfStep

    layer = _layer({"type": "branch", "num_experts": E, "top_k": 2}, "node")
    x = torch.randn(10, H)
    layer(x)
    if rank == 1:  # fails before any collective (a shape error), and the caller goes on
        assert isinstance(_caught(lambda: layer(torch.randn(10, H + 1))), ValueError)
    err = _caught(lambda: layer(x))  # rank 0's forward 2 meets rank 1's forward 3
    assert isinstance(err, OutOfStep), f"rank {rank}: {err!r}"
    assert "out of step" in str(err)


def test_a_skipped_forward_is_caught_on_every_rank_instead_of_pairing_wrong_batches():
    run_workers(_skipped_forward_worker, 4, timeout=120)
