"""Expert parallelism on 2 and 4 gloo ranks: equal to one process, bytes equal to the analytic count."""

import torch

from dist_moe.dispatch.contract import Tokens
from dist_moe.routing.base import Routing
from tests.support.dist_utils import run_cases


def routes(idx, gates) -> Routing:
    """What the dispatcher reads of a routing: its expert ids and gates."""
    return Routing(torch.empty(0), idx, gates, torch.zeros(()))


def _equivalence_worker(rank, world, sizes):
    from placement import Topology
    from tests.support.ep_checks import run_all

    n = run_all(Topology(("node", "gpu"), sizes))
    assert n > 0


def _property_worker(rank, world):
    """Random token counts (including 0), K, placements, capacities and modes vs the dense reference."""
    import torch
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from dist_moe.dispatch.apply_experts import apply_experts
    from dist_moe.dispatch.dispatcher import ExpertParallelDispatcher, routing_pairs
    from dist_moe.moe.experts import Experts
    from dist_moe.routing.capacity import apply_capacity, capacity_for
    from placement import Placement, Topology, dispatch_traffic

    H, E = 6, 8
    topology = Topology(("node", "gpu"), (2, 2))
    torch.manual_seed(0)
    full = Experts(E, H, 10, "gelu")

    # Every rank draws the same examples (derandomized, no shrinking) so collectives stay in step.
    @settings(max_examples=40, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(
        tokens=st.lists(st.integers(0, 9), min_size=world, max_size=world),
        k=st.integers(1, E),
        perm_seed=st.integers(0, 10**6),
        capacity=st.one_of(st.none(), st.floats(0.2, 2.0)),
        dedup=st.sampled_from(["none", "rank", "node"]),
        seed=st.integers(0, 10**6),
    )
    def check(tokens, k, perm_seed, capacity, dedup, seed):
        g = torch.Generator().manual_seed(perm_seed)
        placement = Placement(Placement.contiguous(E, world).rank_tensor()[torch.randperm(E, generator=g)].tolist(),
                              world)
        disp = ExpertParallelDispatcher(dist.group.WORLD, placement, topology, dedup)
        local = Experts(E // world, H, 10, "gelu")
        ids = placement.local_experts(rank)
        for name, p in local.named_parameters():
            p.data.copy_(getattr(full, name).data[ids])
        g = torch.Generator().manual_seed(seed + rank)
        t = tokens[rank]
        x = torch.randn(t, H, generator=g, requires_grad=True)
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k).long()
        gates = torch.rand(t, k, generator=g, requires_grad=True)
        use_idx, use_gates = idx, gates
        if capacity is not None:
            use_idx, use_gates, _ = apply_capacity(idx, gates, E, capacity_for(t, k, E, capacity) if t else 1)
        y, _ = disp(Tokens(x), routes(use_idx, use_gates), local)
        tok, exp, gate = routing_pairs(use_idx, use_gates)
        y_ref = apply_experts(full, x, tok, exp, gate)
        w = torch.randn(t, H, generator=g)
        def grads():
            out = [torch.zeros_like(v) if v.grad is None else v.grad.clone() for v in (x, gates)]
            x.grad = gates.grad = None
            return out

        (y * w).sum().backward(retain_graph=True)  # the capacity step is shared with the reference
        gx, gg = grads()
        (y_ref * w).sum().backward()
        rx, rg = grads()
        ok = torch.allclose(y, y_ref, atol=1e-5) and torch.allclose(gx, rx, atol=1e-5) \
            and torch.allclose(gg, rg, atol=1e-5)
        analytic = dispatch_traffic(use_idx, rank, placement, topology, H * 4, dedup).matrix
        measured = disp.traffic.clone()
        dist.all_reduce(analytic)
        dist.all_reduce(measured)
        ok = ok and torch.equal(analytic, measured)
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank fails together, none is left waiting
        assert int(flag) == 1, (tokens, k, perm_seed, capacity, dedup, seed)

    check()


def _edge_worker(rank, world):
    """Zero-token ranks, frozen routing with inputs that need no gradient, and two node layouts."""
    import torch
    import torch.distributed as dist

    from dist_moe import MoELayer
    from dist_moe.dispatch.apply_experts import apply_experts
    from dist_moe.dispatch.dispatcher import ExpertParallelDispatcher, routing_pairs
    from dist_moe.moe.experts import Experts
    from placement import Placement, Topology

    H, E = 4, 8
    torch.manual_seed(0)
    full = Experts(E, H, 6)
    placement = Placement.contiguous(E, world)
    topologies = [Topology(("node", "gpu"), (2, 2)), Topology(("node", "socket", "gpu"), (2, 2, 1)),
                  Topology(("rack", "node", "gpu"), (2, 2, 1))]  # same sizes, different nodes: 2 vs 1 rank each
    for topo in topologies:
        for dedup in ("none", "rank", "node"):
            local = Experts(E // world, H, 6)
            for name, p in local.named_parameters():
                p.data.copy_(getattr(full, name).data[placement.local_experts(rank)])
            disp = ExpertParallelDispatcher(dist.group.WORLD, placement, topo, dedup)
            # ranks 1 and 3 hold no tokens; rank 0 routes only to its own experts, rank 2 everywhere.
            # Nothing but the expert weights needs a gradient (a frozen router, a frozen input).
            t = {0: 3, 1: 0, 2: 5, 3: 0}[rank]
            x = torch.randn(t, H)
            own = torch.tensor(placement.local_experts(rank))
            idx = own[:2].expand(t, 2).clone() if rank == 0 else torch.randint(0, E, (t, 1))
            gates = torch.rand(t, idx.shape[1])
            y, _ = disp(Tokens(x), routes(idx, gates), local)
            y.sum().backward()  # must not hang: every rank runs every backward exchange
            full.zero_grad()
            tok, exp, gate = routing_pairs(idx, gates)
            ref = apply_experts(full, x, tok, exp, gate)
            assert torch.allclose(y, ref, atol=1e-6), (topo, dedup)
            ref.sum().backward()
            grads = [getattr(full, n).grad for n, _ in local.named_parameters()]
            summed = [torch.zeros_like(g) if g is None else g.clone() for g in grads]
            for g in summed:
                dist.all_reduce(g)
            for (name, p), g in zip(local.named_parameters(), summed):
                assert torch.allclose(p.grad, g[placement.local_experts(rank)], atol=1e-6), (topo, dedup, name)
    # a whole layer with a parameter-free router and an input without gradient
    layer = MoELayer(H, 6, {"type": "hash", "num_experts": E, "top_k": 2}, group=dist.group.WORLD,
                     topology=topologies[0], dedup="node")
    y, aux = layer(torch.randn(0 if rank == 1 else 4, H))
    y.sum().backward()


def _bad_input_worker(rank, world):
    import pytest as pt
    import torch.distributed as dist

    from dist_moe import MoELayer
    from placement import Placement, Topology

    cfg = {"type": "switch", "num_experts": 4, "top_k": 2}
    g = dist.group.WORLD
    with pt.raises(ValueError, match="placement is for 4 experts on 4 ranks"):
        MoELayer(4, 8, cfg, group=g, placement=Placement.contiguous(4, 4))
    with pt.raises(ValueError, match="8 experts"):
        MoELayer(4, 8, {**cfg, "num_experts": 8}, group=g, placement=Placement.contiguous(4, 2))
    with pt.raises(ValueError, match="has 4 ranks, the group 2"):
        MoELayer(4, 8, cfg, group=g, topology=Topology(("node", "gpu"), (2, 2)))
    with pt.raises(ValueError, match="integral"):
        MoELayer(4, 8, {"type": "switch", "num_experts": 5, "top_k": 2}, group=g)
    dist.barrier()  # nothing above started a collective: every rank is still in step


def _category_worker(rank, world):
    """Hard SpecDrop routes each token to its category's expert only: tokens dealt to random ranks must
    come back with exactly that expert's output (categories travel with their tokens)."""
    import torch
    import torch.distributed as dist

    from dist_moe import MoELayer
    from placement import Placement, Topology

    H, E, n = 6, 8, 60
    g = torch.Generator().manual_seed(7)
    x_all = torch.randn(n, H, generator=g)
    cats_all = torch.randint(0, 16, (n,), generator=g)  # 16 categories round-robin onto 8 experts
    owner = torch.randint(0, world, (n,), generator=g)  # a random permutation of tokens over ranks
    placement = Placement(torch.randperm(E, generator=g).remainder(world).tolist(), world)
    for dedup in ("none", "rank", "node"):
        torch.manual_seed(0)
        full = MoELayer(H, 10, {"type": "specdrop", "num_experts": E, "num_categories": 16, "p_assigned": 1.0,
                                "variant": "hard", "top_k": 1})
        layer = MoELayer(H, 10, {"type": "specdrop", "num_experts": E, "num_categories": 16, "p_assigned": 1.0,
                                 "variant": "hard", "top_k": 1}, group=dist.group.WORLD, placement=placement,
                         topology=Topology(("node", "gpu"), (2, 2)), dedup=dedup)
        for name, p in layer.experts.named_parameters():
            p.data.copy_(getattr(full.experts, name).data[layer.local_expert_ids])
        mine = owner == rank
        y, _ = layer(x_all[mine], categories=cats_all[mine])
        for row, (x, c) in zip(y, zip(x_all[mine], cats_all[mine])):
            expected = full.experts.expert(int(c) % E, x.unsqueeze(0))[0]  # gate p_a/S = 1
            assert torch.allclose(row, expected, atol=1e-6), (dedup, int(c))


# The cases of one world share one set of ranks (their start costs more than most cases).
def test_two_ranks_ep_layer_equals_one_process_and_bad_configurations_fail_before_any_collective():
    run_cases(2, [(_equivalence_worker, (2, 1)), (_equivalence_worker, (1, 2)), (_bad_input_worker,)], timeout=300)


def test_four_ranks_ep_layer_equals_one_process_dispatch_combine_properties_edges_and_categories():
    """2 nodes x 2 equals one process; dispatch/combine properties; zero tokens, frozen inputs and
    two-node layouts; categories travel with their tokens."""
    run_cases(4, [(_equivalence_worker, (2, 2)), (_property_worker,), (_edge_worker,), (_category_worker,)],
              timeout=600)
