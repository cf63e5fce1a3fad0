"""Subtree-limited BRANCH: a token's K experts from at most M of the 2^d subtrees at depth d,
ranked by path mass; M = 2^d is the paper's router exactly."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_moe import MoELayer
from dist_moe.routing import build_router
from placement import Placement, Topology
from placement.subtree import limited_top_k


def _router(e, k, **kw):
    return build_router({"type": "branch", "hidden_size": 8, "num_experts": e, "top_k": k, **kw})


@settings(max_examples=60, deadline=None)
@given(log_e=st.integers(1, 8), data=st.data())
def test_limited_routing_never_leaves_the_kept_subtrees(log_e, data):
    e = 1 << log_e
    d = data.draw(st.integers(0, log_e))
    m = data.draw(st.integers(1, 1 << d))
    k = data.draw(st.integers(1, min(e, m * (e >> d))))
    seed = data.draw(st.integers(0, 10**6))
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(37, e, generator=g) * 3, dim=1)
    vals, idx = limited_top_k(probs, k, [(d, m)])
    size = e >> d
    mass = probs.reshape(37, 1 << d, size).sum(-1)
    kept = torch.sort(mass, dim=1, descending=True, stable=True).indices[:, :m]
    for t in range(37):
        subtrees = set((idx[t] // size).tolist())
        assert subtrees <= set(kept[t].tolist()) and len(subtrees) <= m
        inside = torch.cat([torch.arange(s * size, (s + 1) * size) for s in kept[t].tolist()])
        best = torch.sort(probs[t, inside], descending=True, stable=True).values[:k]
        assert torch.equal(vals[t], best)  # the top-K leaves inside the kept subtrees, highest first
    assert torch.equal(vals, probs.gather(1, idx))


@pytest.mark.parametrize("e,k,d", [(16, 4, 2), (64, 8, 3), (8, 1, 1), (256, 8, 4)])
def test_the_limit_at_its_maximum_is_the_unlimited_router(e, k, d):
    torch.manual_seed(0)
    base = _router(e, k)
    full = _router(e, k, subtree_limit=1 << d, subtree_depth=d)
    full.load_state_dict(base.state_dict())
    x = torch.randn(200, 8)
    a, b = base(x), full(x)
    assert torch.equal(a.expert_idx, b.expert_idx) and torch.equal(a.gates, b.gates)
    assert torch.equal(base.anchors, full.anchors) and int(base.ema_step) == int(full.ema_step)


def test_gates_follow_the_eta_rule_and_anchors_move_as_before():
    torch.manual_seed(0)
    base, lim = _router(16, 4), _router(16, 4, subtree_limit=1, subtree_depth=1)
    lim.load_state_dict(base.state_dict())
    for _ in range(5):
        x = torch.randn(64, 8)
        a, b = base(x), lim(x)
        assert torch.equal(a.probs, b.probs)  # the tree and its masks are the paper's
        kept = b.probs.gather(1, b.expert_idx)
        assert torch.allclose(b.gates, kept / kept.sum(1, keepdim=True))  # eta = 1 over the kept selection
    assert torch.equal(base.anchors, lim.anchors)  # the limit only selects: anchors and EMA untouched
    one = _router(16, 1, subtree_limit=1, subtree_depth=2)  # K=1: eta = 0, the raw leaf mass
    r = one(torch.randn(10, 8))
    assert torch.equal(r.gates, r.probs.gather(1, r.expert_idx))
    r.gates.sum().backward()
    assert one.node_map.weight.grad.abs().sum() > 0  # gradients flow through the kept path masses


@pytest.mark.parametrize("kw,key", [
    ({"subtree_limit": 0, "subtree_depth": 1}, "subtree_limit"),
    ({"subtree_limit": 3, "subtree_depth": 1}, "subtree_limit"),
    ({"subtree_limit": 1, "subtree_depth": 5}, "subtree_depth"),
    ({"subtree_limit": 1, "subtree_depth": 3}, "subtree_limit"),  # top_k 4 > 1 subtree of 2 experts
    ({"subtree_depth": 2}, "subtree_depth"),
    ({"subtree_limit": {"node": 0}}, "subtree_limit"),
    ({"subtree_limit": "one"}, "subtree_limit"),
])
def test_bad_limits_name_the_key(kw, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        _router(16, 4, **kw)


def test_a_limit_by_level_is_resolved_from_the_topology_and_tree_prefix_placement():
    topo = Topology(("rack", "node", "gpu"), (2, 2, 2))
    from dist_moe.moe.cluster import bind_to_topology

    router = _router(16, 4, subtree_limit={"rack": 1, "node": 2})  # resolved for the 8 ranks, as an EP layer would
    bind_to_topology(router, Placement.tree_prefix(16, topo), topo)
    assert router.subtree_levels == [(1, 1), (2, 2)]
    r = router(torch.randn(300, 8))
    assert ((r.expert_idx // 8).amin(1) == (r.expert_idx // 8).amax(1)).all()  # one rack (8 experts)
    assert all(len(set(row)) <= 2 for row in (r.expert_idx // 4).tolist())  # at most 2 of its nodes
    int_limit = _router(16, 4, subtree_limit=1)  # an int: the node level
    bind_to_topology(int_limit, Placement.tree_prefix(16, topo), topo)
    assert int_limit.subtree_levels == [(2, 1)]


def test_a_limit_by_level_under_another_placement_is_refused_unless_the_depth_is_given():
    from dist_moe.moe.cluster import bind_to_topology

    topo = Topology(("node", "gpu"), (2, 2))
    with pytest.raises(ValueError, match="tree_prefix: under another placement the tree's subtrees are not nodes"):
        bind_to_topology(_router(16, 4, subtree_limit=1), Placement.round_robin(16, 4), topo)
    explicit = _router(16, 4, subtree_limit=1, subtree_depth=1)
    bind_to_topology(explicit, Placement.round_robin(16, 4), topo)  # the user's own choice of subtrees
    assert explicit.subtree_levels == [(1, 1)]
    with pytest.raises(ValueError, match="needs the topology|knows the topology"):
        _router(16, 4, subtree_limit=1)(torch.randn(4, 8))


def _one_copy_worker(rank, world, out):
    import json

    import torch.distributed as dist

    topo = Topology(("node", "gpu"), (2, 2))
    torch.manual_seed(0)
    layer = MoELayer(8, 12, {"type": "branch", "num_experts": 16, "top_k": 4, "subtree_limit": 1}, topology=topo,
                     placement=Placement.tree_prefix(16, topo), group=dist.group.WORLD, dedup="node")
    x = torch.randn(50 + 7 * rank, 8, generator=torch.Generator().manual_seed(rank))
    layer(x)
    node_of_token = layer.last_routing.expert_idx[:, 0] // 8  # every selected expert is on this node
    assert ((layer.last_routing.expert_idx // 8) == node_of_token.unsqueeze(1)).all()
    off_node = int((node_of_token != rank // 2).sum())
    totals = torch.tensor([off_node, layer.traffic.by_level()["node"], x.shape[0]])
    dist.all_reduce(totals)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(totals.tolist(), f)


def test_limit_one_on_two_nodes_sends_one_node_copy_per_off_node_token(tmp_path):
    """2 nodes x 2, tree-prefix placement, node dedup, subtree_limit 1 (the node level): exactly one
    copy crosses the node boundary for each token routed to the other node, none for the rest."""
    import json

    from tests.support.dist_utils import run_workers

    out = tmp_path / "totals.json"
    run_workers(_one_copy_worker, 4, args=(str(out),), timeout=120)
    off_node, node_bytes, tokens = json.loads(out.read_text())
    assert node_bytes == off_node * 8 * 4  # one 8-float copy each
    assert 0 < off_node < tokens


def _limited_record(e=16, k=4, t=400, seed=0):
    """A synthetic recorded run: tokens' router probabilities and their unlimited top-K."""
    from placement.simulate import RoutingRecord

    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(2 * torch.randn(t, e, generator=g), dim=1)
    idx = torch.sort(probs, dim=1, descending=True, stable=True).indices[:, :k]
    return RoutingRecord(idx, torch.zeros(t, dtype=torch.long), e, 1, 32, probs=probs)


def test_simulate_replays_the_limit_beside_the_unlimited_routing():
    """4 nodes x 2 GPUs (E_sim = 16, 4 experts a node): a node limit of 1 sends at most one copy
    across nodes per token with node dedup, less than unlimited; a limit of every node is unlimited."""
    from placement.simulate import simulate

    record = _limited_record()
    topo = Topology(("node", "gpu"), (4, 2))
    out = simulate(record, topo, "tree_prefix", tokens_per_rank=100, subtree_limit=1)
    assert out["subtree_levels"] == [(2, 1)]
    limited = out["limited"]["node"]["bytes_per_token_by_level"]["node"]
    unlimited = out["modes"]["node"]["bytes_per_token_by_level"]["node"]
    assert 0 < limited <= 32 < unlimited
    # copies that cross nodes are exactly the tokens whose one node is not their own (3/4 of them)
    assert abs(limited / 32 - 0.75) < 0.08
    full = simulate(record, topo, "tree_prefix", tokens_per_rank=100, subtree_limit={"node": 4})
    assert full["limited"] == full["modes"]


def test_simulate_limits_racks_and_nodes_from_the_cli(tmp_path, capsys):
    from dist_moe.cli import main

    record = _limited_record(e=32)
    record.save(tmp_path)
    args = ["simulate", "--stats", str(tmp_path), "--racks", "2", "--nodes", "2", "--gpus-per-node", "4", "--json"]
    assert main(args + ["--subtree-limit", "rack=1,node=1"]) == 0
    out = json.loads(capsys.readouterr().out)
    # 16 simulated ranks hold 32 experts: a rack spans 16 (depth 1 of the 32-tree), a node 8 (depth 2)
    assert out["topology"] == "rack=2,node=2,gpu=4" and out["subtree_levels"] == [[1, 1], [2, 1]]
    lim, free = out["limited"]["node"]["bytes_by_level"], out["modes"]["node"]["bytes_by_level"]
    assert lim["rack"] < free["rack"] and lim["node"] < free["node"]
    for bad, word in (("node=0", "node=0"), ("pod=1", "pod"), ("x", "x"), ("0", "'0'")):
        assert main(args + ["--subtree-limit", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert word in err and len(err.splitlines()) == 1, err


def test_node_share_in_metrics_and_report(tmp_path):
    from dist_moe.train.metrics.routing import routing_metrics
    from placement.report import write_report

    idx = torch.tensor([[0, 1], [0, 2], [3, 1], [3, -1]])  # slots per expert: 2, 2, 1, 2
    load = torch.tensor([2.0, 2.0, 1.0, 2.0])
    m = routing_metrics(idx, load, 1, 4, expert_node=torch.tensor([0, 0, 1, 1]))
    assert m["node_share"] == [round(4 / 7, 5), round(3 / 7, 5)]
    assert m["node_share_cv"] == pytest.approx(abs(4 / 7 - 3 / 7) / 2 / 0.5)
    from placement.simulate import RoutingRecord

    record = RoutingRecord(idx, torch.arange(4) % 4, 4, 4, 16)
    topo = Topology(("node", "gpu"), (2, 2))
    record.save(tmp_path)
    report = write_report(tmp_path, topo)
    assert report["placements"]["contiguous"]["node_share"] == m["node_share"]
    assert "slots dispatched, after capacity drops; the training summary's node share is of the router's load " \
        "before them): layer 0 contiguous 0.571 / 0.429 (CV 0.143); layer 0 tree_prefix 0.571 / 0.429 (CV 0.143); " \
        "layer 0 optimized" in (tmp_path / "report.md").read_text()


def test_simulate_refuses_a_limit_its_placement_does_not_hold():
    """Subtrees that are not units of the level limit nothing across it: refused, naming the level."""
    from placement.simulate import simulate

    record = _limited_record()
    for topo, kind in ((Topology(("node", "gpu"), (8, 3)), "contiguous"),  # 6 experts a node: not a subtree
                       (Topology(("node", "gpu"), (2, 3)), "contiguous"),  # blocks straddle the nodes
                       (Topology(("node", "gpu"), (4, 2)), "round_robin")):  # subtrees spread over every node
        with pytest.raises(ValueError, match="subtree limit node=1: the .* nodes of"):
            simulate(record, topo, kind, tokens_per_rank=10, subtree_limit={"node": 1})


def test_simulate_limits_inside_each_replica_block():
    """16 nodes x 4 (64 simulated experts, 4 replicas of the recorded 16): a node holds a quarter of
    a block, so the limit is depth 2 of the block's tree, and each token crosses to one node at most."""
    from placement.simulate import simulate

    out = simulate(_limited_record(), Topology(("node", "gpu"), (16, 4)), "tree_prefix", tokens_per_rank=20,
                   subtree_limit=1)
    assert out["replicas"] == 4 and out["subtree_levels"] == [(2, 1)]
    assert out["limited"]["node"]["bytes_per_token_by_level"]["node"] <= 32 < \
        out["modes"]["node"]["bytes_per_token_by_level"]["node"]


def test_an_unresolved_limit_refuses_before_the_anchors_move():
    router = _router(16, 4, subtree_limit=1).train()
    with pytest.raises(ValueError, match="subtree_limit"):
        router(torch.randn(5, 8))
    assert int(router.ema_step) == 0 and not router.anchors.any()


def test_the_topology_must_be_the_expert_parallel_groups():
    from dist_moe.moe.cluster import bind_to_topology

    router = _router(16, 4, subtree_limit=1)
    with pytest.raises(ValueError, match="node=4,gpu=2 has 8 ranks but the expert-parallel group has 4"):
        bind_to_topology(router, Placement.contiguous(16, 4), Topology(("node", "gpu"), (4, 2)))


def test_a_limit_by_level_merges_with_an_override_of_one_level():
    from dist_moe.train.config import load_config

    cfg = load_config(None, ["router.type=branch", "router.subtree_limit={rack: 1, node: 1}",
                             "router.subtree_limit.node=2"])
    assert cfg.router.subtree_limit == {"rack": 1, "node": 2}


def test_simulate_racks_must_be_positive(tmp_path, capsys):
    from dist_moe.cli import main

    _limited_record().save(tmp_path)
    assert main(["simulate", "--stats", str(tmp_path), "--racks", "0", "--nodes", "2", "--gpus-per-node", "2"]) == 2
    assert "--racks must be >= 1, got 0" in capsys.readouterr().err


def test_the_engine_hosts_resolve_the_limit_from_their_topology():
    """DeepSpeed's gate and Megatron's router, given the EP group's topology, bind the limit as
    MoELayer does (the node level: depth 1 on 2 x 2) and refuse a placement whose subtrees are not nodes."""
    pytest.importorskip("megatron.core")
    from dist_moe.integrations.megatron import patches as megatron_patches

    megatron_patches.apply()
    from dist_moe.integrations.deepspeed import DistMoEGate
    from dist_moe.integrations.megatron import DistMoERouter, megatron_config

    topo = Topology(("node", "gpu"), (2, 2))
    meg = DistMoERouter(config=megatron_config(8, 16, 16, 4, ep_size=4), router={"type": "branch", "subtree_limit": 1},
                        placement=Placement.tree_prefix(16, topo), topology=topo)
    ds = DistMoEGate({"type": "branch", "num_experts": 16, "top_k": 4, "subtree_limit": {"node": 1}}, 8, ep_size=4,
                     topology=topo)
    assert meg.router.subtree_levels == ds.router.subtree_levels == [(1, 1)]
    with pytest.raises(ValueError, match="needs parallel.placement=tree_prefix"):
        DistMoEGate({"type": "branch", "num_experts": 16, "top_k": 4, "subtree_limit": 1}, 8, ep_size=4,
                    placement=Placement.round_robin(16, 4), topology=topo)


# --- subtree_balance: a selection bias per tree node that equalises the limit's hard selections


def test_balance_step_moves_each_limited_depth_and_the_leaves_by_the_sign_rule():
    from placement.subtree import balance_step, node_bias

    bias = torch.zeros(2 * 8 - 2)
    load = torch.tensor([5.0, 1, 1, 1, 0, 0, 0, 0])  # node 0 (leaves 0-3) holds every slot
    balance_step(bias, load, [(1, 1)], rate=0.4)
    assert torch.equal(node_bias(bias, 1), torch.tensor([-0.2, 0.2]))  # rate / 2^1, toward the mean
    assert torch.equal(node_bias(bias, 3), torch.tensor([-0.05, 0, 0, 0, 0.05, 0.05, 0.05, 0.05]))  # at the mean: 0
    assert torch.equal(node_bias(bias, 2), torch.zeros(4))  # depth 2 is not limited: untouched
    balance_step(bias, torch.full((8,), 2.0), [(1, 1), (2, 2)], rate=0.4)  # equal load: nothing moves
    assert torch.equal(node_bias(bias, 1), torch.tensor([-0.2, 0.2]))


@pytest.mark.parametrize("e,k,limits", [(16, 4, [(1, 1)]), (32, 8, [(1, 1), (2, 2)]), (8, 2, [(2, 1)])])
def test_a_zero_balance_selects_what_the_unbalanced_limit_selects(e, k, limits):
    g = torch.Generator().manual_seed(e)
    probs = torch.softmax(torch.randn(300, e, generator=g) * 2, dim=1)
    a_vals, a_idx = limited_top_k(probs, k, limits)
    b_vals, b_idx = limited_top_k(probs, k, limits, torch.zeros(2 * e - 2))
    assert torch.equal(a_idx, b_idx) and torch.equal(a_vals, b_vals)
    planted = torch.zeros(2 * e - 2)
    from placement.subtree import node_bias
    node_bias(planted, limits[0][0])[0] = 0.5  # a bias toward the first limited subtree changes the choice
    assert not torch.equal(limited_top_k(probs, k, limits, planted)[1], a_idx)


def test_the_balance_equalises_hard_node_and_leaf_loads_on_skewed_scores():
    from placement.subtree import balance_step

    e, k, limits = 16, 4, [(1, 1)]
    g = torch.Generator().manual_seed(0)
    skew = torch.linspace(1.5, 0.0, e)  # every token prefers node 0 and its low leaves
    bias = torch.zeros(2 * e - 2)

    def loads(b):
        probs = torch.softmax(torch.randn(512, e, generator=g) + skew, dim=1)
        idx = limited_top_k(probs, k, limits, b)[1]
        return torch.bincount(idx.flatten(), minlength=e).float()

    before = loads(None)
    for _ in range(300):
        balance_step(bias, loads(bias), limits, rate=1e-2)
    after = sum(loads(bias) for _ in range(10))
    node = lambda load: load.reshape(2, -1).sum(1)  # noqa: E731
    ratio = lambda v: float(v.max() / v.mean())  # noqa: E731
    assert ratio(node(before)) > 1.5 and ratio(before) > 2.0  # unbalanced: the limit's hard choices
    assert ratio(node(after)) < 1.05 and ratio(after) < 1.15, (node(after), after)


def test_subtree_balance_options_and_state():
    none = _router(16, 4, subtree_limit=1, subtree_depth=1, subtree_balance="none")
    assert "balance_bias" not in none.state_dict()
    biased = _router(16, 4, subtree_limit=1, subtree_depth=1)  # the default: by measurement
    assert biased.subtree_balance == "bias" and biased.balance_bias.shape == (30,)
    assert _router(16, 4).subtree_balance == "none"  # no limit, nothing to balance
    biased.train()(torch.randn(64, 8) * 3)
    assert biased.balance_bias.abs().sum() > 0  # moved by a training forward...
    frozen = biased.balance_bias.clone()
    biased.eval()(torch.randn(64, 8))
    assert torch.equal(frozen, biased.balance_bias)  # ...never by evaluation
    fresh = _router(16, 4, subtree_limit=1, subtree_depth=1)
    fresh.load_state_dict(biased.state_dict())
    assert torch.equal(fresh.balance_bias, frozen)  # a checkpoint carries it
    old = {k: v for k, v in biased.state_dict().items() if k != "balance_bias"}
    fresh.load_state_dict(old)  # a state dict from before the balance: it starts at zero
    assert not fresh.balance_bias.any()
    none.load_state_dict(old)  # and an unbalanced router loads it as before
    # one node limits nothing, so there is nothing to balance: the layer routes as without a limit
    torch.manual_seed(0)
    plain = MoELayer(8, 8, {"type": "branch", "num_experts": 16, "top_k": 4})
    torch.manual_seed(0)
    one_node = MoELayer(8, 8, {"type": "branch", "num_experts": 16, "top_k": 4, "subtree_limit": 1})
    x = torch.randn(50, 8) * 3
    for _ in range(3):
        assert torch.equal(plain(x)[0], one_node(x)[0])
    assert not one_node.router.balance_bias.any()


@pytest.mark.parametrize("kw,fragment", [
    ({"subtree_limit": 1, "subtree_depth": 1, "subtree_balance": "quantile"}, "'subtree_balance' must be one of"),
    ({"subtree_balance": "bias"}, "give subtree_limit"),
    ({"subtree_limit": 1, "subtree_depth": 1, "balance_rate": 0}, "'balance_rate' must be a number > 0"),
    ({"subtree_limit": 1, "subtree_depth": 1, "balance_rate": float("nan")}, "'balance_rate'"),
])
def test_bad_balance_keys_name_the_key(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        _router(16, 4, **kw)
