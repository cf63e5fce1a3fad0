"""Zero-token ranks, one rank with an empty batch, all tokens to one expert: no hang, and the
results of a single process with the same weights."""
import torch

from dist_moe.dispatch.contract import Tokens
from dist_moe.routing.base import Routing
from tests.support.dist_utils import run_workers


def routes(idx, gates) -> Routing:
    """What the dispatcher reads of a routing: its expert ids and gates."""
    return Routing(torch.empty(0), idx, gates, torch.zeros(()))


def _empty_rank_trainer(rank, world, out):
    from dist_moe.train.config import load_config
    from dist_moe.train.trainer import train

    # 401 training rows, 2 x 200 per step: every epoch's second step gives rank 0 one row, rank 1 none
    cfg = load_config(None, ["data.max_rows=501", "train.batch_size=200", "train.epochs=3",
                             "router.num_experts=8", "router.top_k=2", f"output.dir={out}"])
    summary = train(cfg, quiet=True)
    assert summary["steps"] == 6 and summary["skipped_steps"] == 0
    assert summary["val_loss"] is not None and summary["val_loss"] < 0.69  # it learned (chance: ln 2)


def test_a_rank_with_an_empty_batch_trains(tmp_path):
    run_workers(_empty_rank_trainer, 2, args=(str(tmp_path),), timeout=180)


def _one_expert_worker(rank, world):
    import torch
    import torch.distributed as dist

    from dist_moe.dispatch.apply_experts import apply_experts
    from dist_moe.dispatch.dispatcher import ExpertParallelDispatcher, routing_pairs
    from dist_moe.moe.experts import Experts
    from placement import Placement, Topology

    torch.manual_seed(0)
    E, H = 8, 6
    full = Experts(E, H, 10)
    topo = Topology(("node", "gpu"), (2, 2))
    placement = Placement.tree_prefix(E, topo)
    for dedup in ("none", "rank", "node"):
        local = Experts(E // world, H, 10)
        for name, p in local.named_parameters():
            p.data.copy_(getattr(full, name).data[placement.local_experts(rank)])
        disp = ExpertParallelDispatcher(dist.group.WORLD, placement, topo, dedup)
        t = 0 if rank == 3 else 7 * (rank + 1)  # rank 3 holds no tokens
        x = torch.randn(t, H, requires_grad=True)
        idx = torch.full((t, 1), 5)  # every token of every rank to expert 5 (rank 2's)
        gates = torch.rand(t, 1)
        y, _ = disp(Tokens(x), routes(idx, gates), local)
        y.square().sum().backward()
        tok, exp, gate = routing_pairs(idx, gates)
        x_ref = x.detach().clone().requires_grad_()
        full.zero_grad()
        ref = apply_experts(full, x_ref, tok, exp, gate)
        ref.square().sum().backward()
        assert torch.allclose(y, ref, atol=1e-6) and torch.allclose(x.grad, x_ref.grad, atol=1e-6), dedup
        grads = {n: getattr(full, n).grad.clone() for n, _ in local.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)
        for name, p in local.named_parameters():  # the one busy expert's gradient holds every rank's tokens
            assert torch.allclose(p.grad, grads[name][placement.local_experts(rank)], atol=1e-5), (dedup, name)


def test_all_tokens_to_one_expert_with_an_idle_rank():
    run_workers(_one_expert_worker, 4, timeout=180)
