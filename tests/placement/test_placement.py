"""placement: topology, placements, byte rules, cost model (no process group anywhere)."""
import itertools
import math
import re

import pytest
import torch

from placement import (
    CostModel,
    Placement,
    Topology,
    Traffic,
    cut_weight,
    dispatch_traffic,
    fit_level,
    tree_distance,
)


def test_topology_coordinates_and_crossings():
    t = Topology(("rack", "node", "gpu"), (2, 3, 4))
    assert t.world_size == 24 and t.num_nodes == 6 and t.ranks_per_node == 4
    assert t.coords(0) == (0, 0, 0) and t.coords(23) == (1, 2, 3) and t.coords(13) == (1, 0, 1)
    assert t.crossing_level(0, 1) == "gpu" and t.crossing_level(0, 4) == "node" and t.crossing_level(0, 12) == "rack"
    assert t.crossing_level(5, 5) is None
    assert t.node_of(13) == 3 and t.local_index(13) == 1 and t.gateway(13, 0) == 1
    lm = t.level_matrix()
    for a, b in itertools.product(range(24), repeat=2):
        name = t.crossing_level(a, b)
        assert lm[a, b] == (-1 if name is None else t.levels.index(name))
    with pytest.raises(ValueError, match="rank 24"):
        t.coords(24)
    with pytest.raises(ValueError, match="one size per level"):
        Topology(("node", "gpu"), (2,))
    with pytest.raises(ValueError, match="positive ints"):
        Topology(("node", "gpu"), (2, 0))


def test_topology_from_env_torchrun_deepspeed_and_override():
    # two torchrun --nnodes 2 --node_rank i invocations of 2 processes each, on one host
    torchrun = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "RANK": "3", "LOCAL_RANK": "1"}
    assert Topology.from_env(env=torchrun) == Topology(("node", "gpu"), (2, 2))
    deepspeed = {"WORLD_SIZE": "8", "LOCAL_SIZE": "4", "CROSS_SIZE": "2", "RANK": "5"}
    assert Topology.from_env(env=deepspeed) == Topology(("node", "gpu"), (2, 4))
    assert Topology.from_env(env={"WORLD_SIZE": "8", "DIST_MOE_TOPOLOGY": "rack=2,node=2,gpu=2"}).levels == (
        "rack", "node", "gpu")
    assert Topology.from_env("node=4,gpu=2", env={}).sizes == (4, 2)
    with pytest.raises(ValueError, match="WORLD_SIZE=6"):
        Topology.from_env("node=2,gpu=2", env={"WORLD_SIZE": "6"})
    with pytest.raises(ValueError, match="not a multiple"):
        Topology.from_env(env={"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="CROSS_SIZE"):
        Topology.from_env(env={"WORLD_SIZE": "8", "LOCAL_SIZE": "4", "CROSS_SIZE": "3"})
    with pytest.raises(ValueError, match="WORLD_SIZE is not set"):
        Topology.from_env(env={})
    with pytest.raises(ValueError, match="level=size"):
        Topology.parse("node:2")


def test_topology_from_env_reads_a_calibrated_topology_file(tmp_path):
    """DIST_MOE_TOPOLOGY naming dist-moe calibrate's file gives its ranks and its measured link costs."""
    path = tmp_path / "cluster.yaml"
    path.write_text("levels: [node, gpu]\nsizes: [2, 2]\ncost: {node: {bandwidth_Bps: 4.0e+7, alpha_s: 0.001}}\n"
                    "exchange: {latency_s: 0.002}\n")
    topo = Topology.from_env(env={"WORLD_SIZE": "4", "DIST_MOE_TOPOLOGY": str(path)})
    assert topo == Topology(("node", "gpu"), (2, 2))
    assert (topo.cost.levels["node"].bandwidth_Bps, topo.cost.levels["node"].alpha_s) == (4.0e7, 0.001)
    assert topo.cost.latency_s == 0.002
    with pytest.raises(ValueError, match="WORLD_SIZE=8"):
        Topology.from_env(env={"WORLD_SIZE": "8", "DIST_MOE_TOPOLOGY": str(path)})
    with pytest.raises(ValueError, match=r"^DIST_MOE_TOPOLOGY=.*missing.yaml' does not exist"):
        Topology.from_env(env={"WORLD_SIZE": "4", "DIST_MOE_TOPOLOGY": str(tmp_path / "missing.yaml")})


def test_topology_yaml_and_hostfile(tmp_path):
    y = tmp_path / "topo.yaml"
    y.write_text("levels: [node, gpu]\nsizes: [2, 8]\ncost:\n  node: {bandwidth_Bps: 5.0e10}\n")
    t = Topology.from_yaml(y)
    assert t.sizes == (2, 8) and t.cost.levels["node"].bandwidth_Bps == 5e10
    assert t.cost.levels["gpu"].bandwidth_Bps == CostModel.default(("node", "gpu")).levels["gpu"].bandwidth_Bps
    y.write_text("levels: [node, gpu]\nsizes: [2, 8]\ncost:\n  nic: {alpha_s: 1}\n")
    with pytest.raises(ValueError, match="'nic'"):
        Topology.from_yaml(y)
    h = tmp_path / "hostfile"
    h.write_text("# cluster\nworker-1 slots=4\nworker-2 slots=4\n\n")
    assert Topology.from_hostfile(h) == Topology(("node", "gpu"), (2, 4))
    h.write_text("worker-1 slots=4\nworker-2 slots=2\n")
    with pytest.raises(ValueError, match="same slots"):
        Topology.from_hostfile(h)
    h.write_text("worker-1\n")
    with pytest.raises(ValueError, match="slots=N"):
        Topology.from_hostfile(h)


def test_placements_and_validation(tmp_path):
    c = Placement.contiguous(8, 4)
    assert c.expert_to_rank == [0, 0, 1, 1, 2, 2, 3, 3] and c.local_experts(2) == [4, 5]
    r = Placement.round_robin(8, 4)
    assert r.expert_to_rank == [0, 1, 2, 3, 0, 1, 2, 3] and r.local_experts(1) == [1, 5]
    assert r.local_slot_tensor().tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    path = tmp_path / "p.yaml"
    r.to_yaml(path)
    assert Placement.from_yaml(path) == r
    with pytest.raises(ValueError, match="integral"):
        Placement.contiguous(6, 4)
    with pytest.raises(ValueError, match="every rank must hold"):
        Placement([0, 0, 0, 1], 2)
    with pytest.raises(ValueError, match="outside"):
        Placement([0, 2], 2)
    with pytest.raises(ValueError, match="layer has 16 experts"):
        c.check(16, 4)


@pytest.mark.parametrize("sizes, experts", [((2, 4), 16), ((2, 2, 2), 32), ((4, 2), 64), ((2, 2), 4)])
def test_tree_prefix_subtrees_never_straddle_a_node(sizes, experts):
    levels = ("rack", "node", "gpu")[-len(sizes):]
    t = Topology(levels, sizes)
    p = Placement.tree_prefix(experts, t)
    for node in range(t.num_nodes):
        held = sorted(e for e in range(experts) if t.node_of(p.rank_of(e)) == node)
        # a complete subtree: a contiguous, aligned block of a power-of-two size
        assert held == list(range(held[0], held[0] + len(held))) and held[0] % len(held) == 0
    # with ranks in mixed radix this is the contiguous placement: prefixes are addresses
    assert p == Placement.contiguous(experts, t.world_size)


def test_tree_prefix_non_power_of_two_stays_contiguous():
    t = Topology(("node", "gpu"), (3, 2))
    p = Placement.tree_prefix(12, t)
    assert [sorted(e for e in range(12) if t.node_of(p.rank_of(e)) == n) for n in range(3)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def planted(E=16, groups=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(E, generator=g)
    block = torch.zeros(E, dtype=torch.long)
    block[perm] = torch.arange(E) // (E // groups)  # expert -> planted group, scrambled ids
    c = torch.rand(E, E, generator=g) * 0.2
    same = block.unsqueeze(0) == block.unsqueeze(1)
    c = c + same * 5.0
    c = (c + c.t()) / 2
    c.fill_diagonal_(0)
    return c, block


def test_optimized_recovers_planted_blocks_and_lowers_node_bytes():
    c, block = planted()
    t = Topology(("node", "gpu"), (4, 2))
    p = Placement.optimized(c, t)
    nodes = torch.tensor([t.node_of(p.rank_of(e)) for e in range(16)])
    for b in range(4):
        assert len(set(nodes[block == b].tolist())) == 1  # each planted group on one node
    contiguous = Placement.contiguous(16, 8)
    cnodes = [t.node_of(contiguous.rank_of(e)) for e in range(16)]
    assert cut_weight(c, nodes) < cut_weight(c, cnodes)
    # a flat router whose co-selections follow the planted blocks: fewer node-crossing bytes
    g = torch.Generator().manual_seed(1)
    groups = torch.randint(0, 4, (400,), generator=g)
    members = [torch.nonzero(block == b).flatten() for b in range(4)]
    idx = torch.stack([members[int(b)][torch.randperm(4, generator=g)[:3]] for b in groups])
    src = torch.randint(0, 8, (400,), generator=g)
    node_bytes = {
        (name, dedup): dispatch_traffic(idx, src, pl, t, 100, dedup).by_level()["node"]
        for name, pl in (("opt", p), ("base", contiguous)) for dedup in ("none", "rank", "node")
    }
    # co-location pays off only when copies are deduplicated: one copy per node (or rank) suffices
    assert node_bytes["opt", "node"] < 0.5 * node_bytes["base", "node"]
    assert node_bytes["opt", "rank"] < 0.8 * node_bytes["base", "rank"]
    # without dedup every (token, expert) copy crosses with the same probability: no gain to expect
    assert abs(node_bytes["opt", "none"] - node_bytes["base", "none"]) < 0.1 * node_bytes["base", "none"]


def test_optimized_is_never_worse_than_contiguous_on_its_objective():
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        c = torch.rand(16, 16, generator=g)
        c = (c + c.t()) / 2
        t = Topology(("node", "gpu"), (2, 2))
        p = Placement.optimized(c, t)
        nodes = [t.node_of(p.rank_of(e)) for e in range(16)]
        base = [t.node_of(Placement.contiguous(16, 4).rank_of(e)) for e in range(16)]
        assert cut_weight(c, nodes) <= cut_weight(c, base) + 1e-9
    with pytest.raises(ValueError, match="square"):
        Placement.optimized(torch.ones(4, 5), Topology(("node", "gpu"), (2, 2)))


def brute_force(expert_idx, src, placement, topology, token_bytes, dedup):
    """The byte rules (placement/plan.py: each copy once per destination rank or node), transcribed token
    by token."""
    w = topology.world_size
    m = torch.zeros(w, w, dtype=torch.long)
    g = topology.ranks_per_node
    for t, row in enumerate(expert_idx.tolist()):
        s = int(src[t]) if torch.is_tensor(src) else src
        dsts = [placement.rank_of(e) for e in row if e >= 0]
        if dedup == "none":
            for d in dsts:
                if d != s:
                    m[s, d] += token_bytes
        elif dedup == "rank":
            for d in set(dsts):
                if d != s:
                    m[s, d] += token_bytes
        else:
            for node in {d // g for d in dsts}:
                gw = node * g + s % g
                if gw != s:
                    m[s, gw] += token_bytes
                for d in {d for d in dsts if d // g == node}:
                    if d != gw:
                        m[gw, d] += token_bytes
    return m


@pytest.mark.parametrize("dedup", ["none", "rank", "node"])
def test_dispatch_traffic_matches_the_rules_token_by_token(dedup):
    g = torch.Generator().manual_seed(2)
    t = Topology(("rack", "node", "gpu"), (2, 2, 2))
    for trial in range(10):
        placement = Placement(Placement.contiguous(16, 8).rank_tensor()[torch.randperm(16, generator=g)].tolist(), 8)
        k = int(torch.randint(1, 6, (1,), generator=g))
        idx = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(30)])
        idx[idx == 3] = -1  # dropped slots
        src = torch.randint(0, 8, (30,), generator=g) if trial % 2 else 5
        tr = dispatch_traffic(idx, src, placement, t, 12, dedup)
        assert torch.equal(tr.matrix, brute_force(idx, src, placement, t, 12, dedup))
        assert sum(tr.by_level().values()) == tr.total


def test_by_level_and_dedup_ordering():
    t = Topology(("node", "gpu"), (2, 2))
    p = Placement.contiguous(8, 4)
    idx = torch.tensor([[2, 3, 4, 6]])  # rank 1 (node 0), ranks 2 and 3 (node 1), from rank 0
    none = dispatch_traffic(idx, 0, p, t, 10, "none").by_level()
    rank = dispatch_traffic(idx, 0, p, t, 10, "rank").by_level()
    node = dispatch_traffic(idx, 0, p, t, 10, "node").by_level()
    assert none == {"node": 20, "gpu": 20}
    assert rank == {"node": 20, "gpu": 10}
    assert node == {"node": 10, "gpu": 20}  # one copy crosses to rank 2, which forwards to rank 3
    with pytest.raises(ValueError, match="dedup"):
        dispatch_traffic(idx, 0, p, t, 10, "token")
    with pytest.raises(ValueError, match="num_experts"):
        dispatch_traffic(torch.tensor([[9]]), 0, p, t, 10)


def test_tree_distance_over_all_pairs_of_16_is_49_60():
    pairs = torch.combinations(torch.arange(16), 2)
    assert math.isclose(tree_distance(pairs, 16), 49 / 60, rel_tol=0, abs_tol=1e-15)


def test_cost_model_estimate_and_fit():
    t = Topology(("node", "gpu"), (2, 2))
    cm = CostModel.default(t.levels)
    m = torch.zeros(4, 4, dtype=torch.long)
    m[0, 2] = 25_000_000  # 25 MB across the node boundary
    m[0, 1] = 150_000_000  # 150 MB inside the node
    node_phase, gpu_phase = 10e-6 + 25e6 / 25e9, 5e-6 + 150e6 / 150e9
    assert math.isclose(cm.estimate(Traffic(m, t), "node"), node_phase + gpu_phase, rel_tol=1e-9)  # two stages
    assert math.isclose(cm.estimate(Traffic(m, t), "rank"), max(node_phase, gpu_phase), rel_tol=1e-9)  # one stage
    # a shared node link carries both ranks of node 0: 25 MB + 50 MB
    m[1, 3] = 50_000_000
    shared = cm.updated({"node": {"shared": True}})
    assert math.isclose(shared.phase_times(m, t)["node"], 10e-6 + 75e6 / 25e9, rel_tol=1e-9)
    assert math.isclose(cm.phase_times(m, t)["node"], 10e-6 + 50e6 / 25e9, rel_tol=1e-9)  # a link per rank
    peers = [1, 1, 3, 3, 2]
    nbytes = [1e6, 4e6, 2e6, 8e6, 5e6]
    secs = [2e-4 * p + b / 5e8 for p, b in zip(peers, nbytes)]
    fitted = fit_level(peers, nbytes, secs)
    assert math.isclose(fitted.alpha_s, 2e-4, rel_tol=1e-6) and math.isclose(fitted.bandwidth_Bps, 5e8, rel_tol=1e-6)


def test_coactivation_counts_every_selection_and_no_dropped_slot():
    """One helper for the recorded runs and the benchmarks. The benchmarks' old copy scattered a 0
    into expert 0's column for each dropped slot, which overwrote a real selection of expert 0."""
    from placement.placement import coactivation

    idx = torch.tensor([[0, -1], [1, 0], [2, 3], [-1, -1], [0, 3]])
    c = coactivation(idx, 4)
    assert c.diagonal().tolist() == [3, 1, 1, 2]  # selections per expert; dropped slots nowhere
    assert c[0, 1] == c[1, 0] == 1 and c[0, 3] == c[3, 0] == 1 and c[2, 3] == 1 and c[0, 2] == 0
    assert torch.equal(c, c.t())


def test_a_placement_name_becomes_a_placement_in_one_place():
    t = Topology(("node", "gpu"), (2, 2))
    assert Placement.named("contiguous", 8, t) == Placement.contiguous(8, 4)
    assert Placement.named("round_robin", 8, t) == Placement.round_robin(8, 4)
    assert Placement.named("tree_prefix", 8, t) == Placement.tree_prefix(8, t)
    with pytest.raises(ValueError, match="placement must be one of contiguous, round_robin, tree_prefix, got 'tree'"):
        Placement.named("tree", 8, t)


def test_experts_that_do_not_share_out_over_the_ranks_name_the_two_ways_out():
    with pytest.raises(ValueError, match=re.escape(
            "2 experts over 4 ranks; set router.num_experts to a positive multiple of 4, or parallel.ep_size to 1 or 2 "
            "(expert-parallel groups whose size divides the experts)")):
        Placement.contiguous(2, 4)
    with pytest.raises(ValueError, match=r"12 experts over 8 ranks; .* parallel\.ep_size to 1, 2 or 4 "):
        Placement.contiguous(12, 8)
