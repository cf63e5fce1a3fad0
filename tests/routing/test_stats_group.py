"""Data-parallel router state: statistics reduced over stats_group agree with one process."""
import torch

from tests.support.dist_utils import run_workers

H, E, T = 5, 8, 24


def _branch_worker(rank, world, out_dir):
    import torch.distributed as dist

    from dist_moe.routing import BranchRouter, DeepSeekV3Router

    torch.manual_seed(0)
    ref = BranchRouter(H, E, 2).train()
    dp = BranchRouter(H, E, 2, stats_group=dist.group.WORLD).train()
    dp.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(T * world, H, generator=g) for _ in range(3)]
    w = torch.randn(T * world, E, generator=g)
    for xb in batches:
        full = ref(xb)
        local = slice(rank * T, (rank + 1) * T)
        part = dp(xb[local])
        assert torch.allclose(part.probs, full.probs[local], atol=1e-6)
        assert torch.allclose(dp.anchors, ref.anchors, atol=1e-6)
    # gradients summed over ranks equal the single-process gradient of the summed loss
    ref.zero_grad(), dp.zero_grad()
    (ref(batches[0]).probs * w).sum().backward()
    local = slice(rank * T, (rank + 1) * T)
    (dp(batches[0][local]).probs * w[local]).sum().backward()
    grad = dp.node_map.weight.grad.clone()
    dist.all_reduce(grad)
    assert torch.allclose(grad, ref.node_map.weight.grad, atol=1e-5)

    # DeepSeek-V3 biases move with the global load, identically on every rank
    torch.manual_seed(0)
    ds = DeepSeekV3Router(H, E, 2, stats_group=dist.group.WORLD).train()
    ds(torch.randn(T, H) + rank * 3.0)  # different local loads
    bias = ds.expert_bias.clone()
    dist.broadcast(bias, 0)
    assert torch.equal(bias, ds.expert_bias)
    assert bias.abs().sum() > 0
    # a rank with zero tokens still joins the reduction and keeps the same state
    torch.manual_seed(0)
    br = BranchRouter(H, E, 2, stats_group=dist.group.WORLD).train()
    br(torch.randn(0 if rank == 1 else T, H))
    anchors = br.anchors.clone()
    dist.broadcast(anchors, 0)
    assert torch.equal(anchors, br.anchors) and int(br.ema_step) == 1

    # the subtree limit's balance bias moves with the hard loads of every replica: equal to one
    # process over the whole batch, and equal on every rank though each rank's tokens differ
    torch.manual_seed(0)
    kw = {"subtree_limit": 1, "subtree_depth": 1, "subtree_balance": "bias"}
    ref = BranchRouter(H, E, 2, **kw).train()
    dp = BranchRouter(H, E, 2, stats_group=dist.group.WORLD, **kw).train()
    dp.load_state_dict(ref.state_dict())
    for step in range(4):
        xb = torch.randn(T * world, H, generator=g) + torch.arange(T * world)[:, None] % 3
        full, part = ref(xb), dp(xb[rank * T:(rank + 1) * T])
        assert torch.equal(part.expert_idx, full.expert_idx[rank * T:(rank + 1) * T]), step
        assert torch.allclose(dp.balance_bias, ref.balance_bias, atol=1e-7), step
    assert ref.balance_bias.abs().sum() > 0
    same = dp.balance_bias.clone()
    dist.broadcast(same, 0)
    assert torch.equal(same, dp.balance_bias)


def test_branch_and_deepseek_state_is_data_parallel_consistent(tmp_path):
    run_workers(_branch_worker, 2, args=(str(tmp_path),), timeout=120)
