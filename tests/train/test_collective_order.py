"""One order of collectives on every rank across every communicator of a step (dist_moe/distributed/
collective_order.py): NCCL with one connection runs collectives of different communicators in the order
they were issued, so ranks that issue them in different orders deadlock. Two MoE layers exchange between
dense layers, and an engine's layer exchanges in its backward through its own dispatcher; the dense
gradients are summed in one-parameter buckets, the routers' in a second sum chained after the first, each
on a communicator of its own; one parameter is used on rank 0 only. A recorder logs every collective each
rank issues and waits for. The rule checked on every rank: no gradient sum is issued before the step's last
exchange collective, and every rank issues the same sequence. A plant on rank 1 only (its sums start as
their gradients arrive) breaks the first rule there alone, and the second on both."""

from tests.support.dist_utils import run_workers

H = 8


def _step(rank, plant: bool):
    import torch
    import torch.distributed as dist
    from torch import nn

    from dist_moe import MoELayer
    from dist_moe.distributed.collective_order import through_exchanges
    from dist_moe.train.step import grad_overlap
    from placement import Topology
    from tests.support.collective_recorder import group_name, recording

    torch.manual_seed(0)
    moe = [MoELayer(H, 12, {"type": "switch", "num_experts": 4, "top_k": 2, "jitter_eps": 0.0},
                    group=dist.group.WORLD, topology=Topology(("node", "gpu"), (1, 2)), capacity_factor=None,
                    pipeline_chunks=2) for _ in range(2)]
    dense = nn.ModuleList([nn.Linear(H, H) for _ in range(4)])
    only_rank0 = nn.Linear(H, H)
    routers = [p for m in moe for p in m.router.parameters()]
    replicated = [*only_rank0.parameters(), *dense.parameters()]  # buckets start from the last: rank 1's stalls last
    first = grad_overlap.OverlappedGradSum(replicated, lambda: dist.new_group([0, 1]), bucket_bytes=1)
    second = grad_overlap.OverlappedGradSum(routers, lambda: dist.new_group([0, 1]), bucket_bytes=1, after=first)
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(rank))
    h = dense[0](x)
    h = dense[1](_EngineExchange.apply(through_exchanges(h)))  # an engine's own dispatcher exchanges in backward
    h = dense[2](h + moe[0](h)[0])
    if rank == 0:
        h = only_rank0(h)
    y = dense[3](h + moe[1](h)[0])
    if plant and rank == 1:
        grad_overlap.exchanges_pending = lambda: 0  # sums start as soon as their gradients arrive
    for s in (first, second):
        s.arm()
    sums = {group_name(s.group) for s in (first, second)}
    with recording() as log:
        y.square().mean().backward()
        for s in (first, second):
            s.finish()
    issued = [(op, g) for kind, op, g, _ in log if kind == "issue"]
    exchanges = [i for i, (op, g) in enumerate(issued) if g not in sums]
    early = [i for i, (op, g) in enumerate(issued) if g in sums and i < max(exchanges)]
    every = [None] * 2
    dist.all_gather_object(every, issued)
    return len(exchanges), early, every


class _EngineExchange(__import__("torch").autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad)  # on the world, as an engine's all-to-all runs on its expert-parallel group
        return grad


def _order_worker(rank, world):
    exchanges, early, every = _step(rank, plant=False)
    assert exchanges >= 9, (rank, exchanges)  # two layers' rows and gate gradients (2 chunks), the engine's
    assert not early, f"rank {rank}: gradient sums issued before the last exchange at {early}"
    assert every[0] == every[1], f"rank {rank}: the ranks issue different sequences"


def _planted_worker(rank, world):
    _, early, every = _step(rank, plant=True)
    assert bool(early) == (rank == 1), (rank, early)
    assert every[0] != every[1], rank


def test_every_rank_issues_one_sequence_with_no_gradient_sum_before_the_last_exchange():
    run_workers(_order_worker, 2)


def test_a_sum_started_early_on_rank_1_only_is_caught_there():
    run_workers(_planted_worker, 2)
