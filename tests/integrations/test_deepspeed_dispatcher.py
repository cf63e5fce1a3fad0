"""dist-moe's dispatcher inside DeepSpeed's MoE layer (``deepspeed_moe_layer(dispatcher="dist_moe")``).

The same model built twice from one seed, once with DeepSpeed's own capacity-padded MOELayer
(DistMoEGate, dropless: nothing is dropped) and once with dist-moe's dispatcher, gives the same
outputs, aux loss and gradients of the input and of every weight, for every dedup and 1 or 3
pipeline chunks; the dispatcher's measured bytes are ``placement.dispatch_traffic``'s. Every rank
checks its own. Training under ``deepspeed.initialize`` with ZeRO 1 and 2 and
``save_checkpoint`` / ``load_checkpoint`` run in ``examples/deepspeed_job.py`` under the
deepspeed launcher (tests/docs/test_examples.py): engines made by ``deepspeed.initialize`` keep
their process groups alive after the job (DeepSpeed's hooks hold the model), which this
harness refuses, and a launched job is what users run.
"""
import pytest

from tests.support.dist_utils import run_cases

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'dist-moe[deepspeed]')")

HIDDEN, FFN, EXPERTS, STEPS, BATCH = 16, 32, 4, 3, 24
ROUTER = {"type": "switch", "num_experts": EXPERTS, "top_k": 2, "jitter_eps": 0.0, "aux_loss_coeff": 0.01}


def _net(world, seed, **dispatch):
    import torch

    from dist_moe.integrations.deepspeed import deepspeed_moe_layer
    from placement import Placement

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.inp = torch.nn.Linear(8, HIDDEN)
            # round-robin: DeepSpeed's physical slots differ from the logical expert ids
            self.moe = deepspeed_moe_layer(HIDDEN, FFN, dict(ROUTER), ep_size=world,
                                           placement=Placement.round_robin(EXPERTS, world), **dispatch)
            self.head = torch.nn.Linear(HIDDEN, 1)

        def forward(self, x):
            h, l_aux, _ = self.moe(torch.relu(self.inp(x)))
            return self.head(h).squeeze(-1), l_aux

    return Net()


def _check_bytes(net, rank, dedup):
    import torch
    import torch.distributed as dist

    from dist_moe.distributed.reductions import all_gather_rows
    from placement import dispatch_traffic

    layer, gate = net.moe.deepspeed_moe, net.moe.deepspeed_moe.gate
    layer.reset_traffic()
    with torch.no_grad():
        net(torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(99 + rank)))
    idx = gate.last_routing.expert_idx
    src = all_gather_rows(torch.full((idx.shape[0],), rank, dtype=torch.long), dist.group.WORLD)
    want = dispatch_traffic(all_gather_rows(idx, dist.group.WORLD), src, gate.placement, layer.topology, HIDDEN * 4,
                            dedup)
    got = layer.traffic.matrix.clone()
    dist.all_reduce(got)
    assert torch.equal(got, want.matrix) and int(got.sum()) > 0, (rank, dedup, got, want.matrix)


def _worker(rank, world, cases):
    """The layer alone (set_deepspeed_parallelism, no engine): outputs, input and every weight's
    gradients equal DeepSpeed's own MOELayer's from the same weights, and the bytes are counted."""
    import torch

    from dist_moe.integrations.deepspeed import init_distributed
    from dist_moe.integrations.deepspeed.dispatch import use_dist_moe_dispatcher

    init_distributed()
    g = torch.Generator().manual_seed(10 + rank)
    x_all, w = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, generator=g)
    reference = _net(world, 0)
    reference.moe.set_deepspeed_parallelism()
    x_ref = x_all.clone().requires_grad_()
    pred, l_aux = reference(x_ref)
    ((pred * w).sum() + l_aux).backward()
    for dedup, chunks in cases:
        ours = _net(world, 0, dispatcher="dist_moe", dedup=dedup, pipeline_chunks=chunks)
        ours.moe.set_deepspeed_parallelism()
        x = x_all.clone().requires_grad_()
        got, aux = ours(x)
        ((got * w).sum() + aux).backward()
        assert torch.allclose(got, pred, atol=1e-6) and torch.allclose(aux, l_aux), (rank, dedup, chunks)
        assert torch.allclose(x.grad, x_ref.grad, atol=1e-6), (rank, dedup, chunks)
        # DeepSpeed's convention: expert counts by physical slot
        assert torch.equal(ours.moe.deepspeed_moe.exp_counts, reference.moe.deepspeed_moe.exp_counts)
        theirs = dict(reference.named_parameters())
        for name, p in ours.named_parameters():  # router, experts (this rank's), the rest
            assert torch.allclose(p.grad, theirs[name].grad, rtol=1e-4, atol=1e-7), (rank, dedup, chunks, name)
        _check_bytes(ours, rank, dedup)
    late = _net(world, 0)  # the dispatcher swapped in after DeepSpeed named the groups
    late.moe.set_deepspeed_parallelism()
    use_dist_moe_dispatcher(late.moe, dedup="rank")
    with torch.no_grad():
        assert torch.allclose(late(x_all)[0], pred, atol=1e-6)


def test_deepspeed_moe_through_dist_moe_dispatcher_equals_its_own_moelayer():
    run_cases(2, [(_worker, [("none", 1), ("rank", 1), ("rank", 3), ("node", 3)])], timeout=300)
