"""`dist-moe plan` (placement/forecast.py): bytes on a planned cluster from the one dispatch plan,
counted without a [W, W] matrix, and the alpha-beta time of a step."""
import json

import pytest
import torch

from placement import Placement, Topology, dispatch_traffic
from placement.forecast import ModelShape, ep_topology, forecast, uniform_routing
from placement.plan import DispatchPlan


@pytest.mark.parametrize("spec", ["node=2,gpu=2", "rack=2,node=2,gpu=2", "node=3,gpu=2"])
@pytest.mark.parametrize("dedup", ["none", "rank", "node"])
def test_copies_per_level_equal_the_analytic_byte_count(spec, dedup):
    topo = Topology.parse(spec)
    w, e = topo.world_size, 4 * topo.world_size
    g = torch.Generator().manual_seed(0)
    idx = uniform_routing(50 * w, e, 3, g)
    idx[::7, 1] = -1  # dropped slots are not sent
    src = torch.arange(w).repeat_interleave(50)
    placement = Placement.round_robin(e, w)
    counts = DispatchPlan.build(idx, placement, topo, dedup, src_rank=src).copies_by_level(topo)
    ours = {lv: sum(stage[lv][0] for stage in counts) * 12 for lv in topo.levels}
    assert ours == dispatch_traffic(idx, src, placement, topo, 12, dedup).by_level()
    for stage in counts:  # per-rank sent and received sum to the level's copies
        for _lv, (n, sent, recv) in stage.items():
            assert int(sent.sum()) == int(recv.sum()) == n


def test_uniform_routing_draws_distinct_experts_evenly():
    idx = uniform_routing(20000, 64, 8, torch.Generator().manual_seed(1))
    assert idx.shape == (20000, 8)
    assert (idx.sort(dim=1).values.diff(dim=1) > 0).all()
    load = torch.bincount(idx.flatten(), minlength=64).double()
    assert float(load.std() / load.mean()) < 0.05


def test_an_ep_group_spans_the_innermost_levels():
    assert ep_topology(Topology.parse("node=2048,gpu=8"), 256).sizes == (32, 8)
    assert ep_topology(Topology.parse("rack=16,node=16,gpu=8"), 4).sizes == (1, 1, 4)
    with pytest.raises(ValueError, match="--ep 12 does not fill whole gpus"):
        ep_topology(Topology.parse("node=6,gpu=8"), 12)


def test_a_step_is_four_exchanges_and_the_experts_per_layer():
    """2 nodes x 1, E=2 top-1, uniform: half of each rank's 1,000 tokens cross, 1,000 B each,
    over a 1 MB/s link without latency: 0.5 s an exchange (to sampling noise)."""
    topo = Topology.parse("node=2,gpu=1")
    topo = Topology(topo.levels, topo.sizes, topo.cost.updated({"node": {"alpha_s": 0, "bandwidth_Bps": 1e6}}))
    shape = ModelShape(hidden=250, ffn=100, experts=2, top_k=1, tokens_per_rank=1000, layers=3, dtype="fp32")
    out = forecast(shape, topo, tflops=1.0, sample=1000, placements=("contiguous",))
    row = next(r for r in out["rows"] if r["dedup"] == "rank")
    assert row["exchange_seconds"] == pytest.approx(0.5, rel=0.1)
    experts = 3 * 2 * 3 * 1000 * 250 * 100 / 1e12
    assert out["expert_seconds"] == pytest.approx(experts)
    assert row["step_seconds"] == pytest.approx(3 * (4 * row["exchange_seconds"] + experts))
    assert row["bytes_per_token_by_level"]["node"] == pytest.approx(500, rel=0.1)


def test_pipelined_rows_overlap_by_the_calibrated_share_and_pay_latency_per_chunk():
    """C = 4 with overlap 1: the slower of exchanges and matmuls, plus a quarter of the faster; with
    overlap 0 the two add as unpipelined, plus every chunk's collectives' latency."""
    topo = Topology.parse("node=2,gpu=1")
    cost = topo.cost.updated({"node": {"alpha_s": 0, "bandwidth_Bps": 1e6}})
    shape = ModelShape(hidden=250, ffn=100, experts=2, top_k=1, tokens_per_rank=1000, layers=3, dtype="fp32")
    for overlap, latency in ((1.0, 0.0), (0.0, 1e-3)):
        t = Topology(topo.levels, topo.sizes, cost.with_exchange(latency, overlap))
        out = forecast(shape, t, tflops=1.0, sample=1000, placements=("contiguous",), chunks=(1, 4))
        one, four = (next(r for r in out["rows"] if r["dedup"] == "rank" and r["chunks"] == c) for c in (1, 4))
        ex, experts = 4 * one["exchange_seconds"], out["expert_seconds"]
        assert one["step_seconds"] == pytest.approx(3 * (ex + experts + 7 * latency))
        short, long = sorted((ex + 16 * latency, experts))
        assert four["step_seconds"] == pytest.approx(3 * (3 * latency + long + short * (1 - overlap + overlap / 4)))
    # node dedup's two stages pipeline against each other; chunks in flight move at the calibrated rate
    node = cost.with_exchange(0.0, 1.0, 0.5).layer_time([0.4, 0.1], compute_s=0.2, chunks=4)
    assert node["exchange_s"] == pytest.approx(4 * (0.4 + 0.1 / 4) * 0.5)
    assert node["layer_s"] == pytest.approx(0.85 + 0.2 / 4)
    assert cost.layer_time([0.4, 0.1], 0.2)["layer_s"] == pytest.approx(4 * 0.5 + 0.2)  # blocking: they add


def test_calibrated_topology_yaml_round_trips(tmp_path):
    import yaml

    from placement.calibrate import to_yaml

    topo = Topology.parse("node=2,gpu=2")
    cost = topo.cost.updated({"node": {"alpha_s": 1e-4, "bandwidth_Bps": 5e7, "shared": True}})
    cost = cost.with_exchange(2e-4, 0.6, 0.8)
    path = tmp_path / "calibrated.yaml"
    path.write_text(yaml.safe_dump(to_yaml(topo, cost)))
    back = Topology.from_yaml(path)
    assert back == topo and back.cost == cost
    path.write_text(yaml.safe_dump({**to_yaml(topo, cost), "exchange": {"latency": 1}}))
    with pytest.raises(ValueError, match="'latency'"):
        Topology.from_yaml(path)


def test_plan_cli_prints_json_and_a_plot_and_names_bad_values(tmp_path, capsys):
    from dist_moe.cli import main

    args = ["plan", "--topology", "node=4,gpu=4", "--link", "gpu=450GB/s", "--link", "node=400Gb/s@5us",
            "--hidden", "1024", "--ffn", "512", "--experts", "64", "--top-k", "4", "--tokens-per-rank", "512"]
    assert main(args + ["--json", "--plot", str(tmp_path / "plan.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ep"] == 16 and len(out["rows"]) == 18 and (tmp_path / "plan.png").stat().st_size > 0
    assert {r["chunks"] for r in out["rows"]} == {1, 4}
    step = {(r["placement"], r["dedup"], r["chunks"]): r["step_seconds"] for r in out["rows"]}
    assert step["contiguous", "rank", 4] == pytest.approx(step["contiguous", "rank", 1])  # uncalibrated: no overlap
    assert main(args + ["--json", "--overlap", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    hidden = {(r["placement"], r["dedup"], r["chunks"]): r["step_seconds"] for r in rows}
    assert hidden["contiguous", "rank", 4] < hidden["contiguous", "rank", 1]
    node = {(r["placement"], r["dedup"]): r["bytes_per_token_by_level"]["node"] for r in out["rows"]}
    assert node["contiguous", "node"] < node["contiguous", "rank"] <= node["contiguous", "none"]
    # each row's bytes on every wire dtype: fp8 is 1024 e4m3 values and 8 fp32 scales a copy (0.258x fp32's)
    for r in out["rows"]:
        wires = r["bytes_per_token_by_wire"]
        assert wires["bf16"] == pytest.approx(r["bytes_per_token_by_level"])  # the shape's dtype: bf16
        for level, v in wires["fp32"].items():
            assert wires["bf16"][level] == pytest.approx(v / 2)
            assert wires["fp8"][level] == pytest.approx(v * 1056 / 4096)
    # the layer's activations for backward: bf16 rows (2 x copies x H on the wire, 2 x pairs x H and SwiGLU's
    # 4 x pairs x F in the experts), per pair its gate and indices, per token the router's E probabilities
    pairs = 512 * 4
    assert out["activation_bytes_per_layer"] == 2 * pairs * 1024 * 2 + pairs * (2 * 1024 + 4 * 512) * 2 \
        + pairs * 36 + 512 * 64 * 4
    for bad, word in ((["--link", "node=fast"], "'fast'"), (["--link", "pod=1GB/s"], "'pod'"),
                      (["--top-k", "99"], "--top-k 99"), (["--dtype", "int4"], "'int4'"), (["--ep", "3"], "--ep 3"),
                      (["--pipeline-chunks", "0"], "'0'"), (["--overlap", "1.5"], "--overlap")):
        assert main(args + bad) == 2
        err = capsys.readouterr().err.strip()
        assert word in err and len(err.splitlines()) == 1, err


def test_the_tables_exposed_ms_is_the_plots_bar_row_by_row(tmp_path, monkeypatch, capsys):
    """One meaning of exposed communication: each printed row's exposed ms is the bar the plot draws for
    that row (the same label; exposed plus the matmuls is the step) and pipelining shrinks it; the plot's
    caption is the table's fold notes."""
    from dist_moe.cli import main, plan

    drawn = []
    monkeypatch.setattr(plan, "_plot", lambda bars, title, path: drawn.append(bars))
    assert main(["plan", "--topology", "node=2,gpu=4", "--link", "gpu=450GB/s", "--link", "node=400Gb/s",
                 "--overlap", "0.8", "--hidden", "512", "--ffn", "256", "--experts", "16", "--top-k", "2",
                 "--tokens-per-rank", "4096", "--layers", "2", "--sample", "64",
                 "--plot", str(tmp_path / "plan.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("placement "))
    assert lines[header].endswith("exposed ms")
    table = [line.split() for line in lines[header + 1:] if line.split()[1:2] in (["none"], ["rank"], ["node"])]
    (bars,) = drawn
    assert bars.labels == [f"{c[0]} / {c[1]} / C={c[2]}" for c in table]
    assert [float(c[-1]) for c in table] == pytest.approx(bars.exposed_ms, abs=0.006)
    assert [float(c[-2]) for c in table] == pytest.approx([e + m for e, m in zip(bars.exposed_ms, bars.matmul_ms)],
                                                          abs=0.006)
    exposed = {(c[0], c[1], c[2]): float(c[-1]) for c in table}
    assert all(exposed[p, d, "4"] < exposed[p, d, "1"] for p, d, _ in exposed)
    printed_notes = [line for line in lines if line.startswith("note: ")]
    assert bars.notes and [f"note: {n}" for n in bars.notes] == printed_notes[:len(bars.notes)]


def test_placements_fold_where_they_cannot_differ_with_a_note_of_which_and_why():
    """Under uniform routing every placement with as many experts on each rank moves the same bytes but for
    the sample's noise: they print once, with the first's numbers and a note naming them all and why;
    under a recorded routing only placements that are the same expert -> rank map fold."""
    from dist_moe.cli.plan import folded_rows, placements_of

    topo = Topology.parse("node=2,gpu=2")
    shape = ModelShape(hidden=256, ffn=512, experts=8, top_k=2, tokens_per_rank=4096, dtype="bf16")
    out = forecast(shape, topo, sample=512, chunks=(1, 4))
    placements = placements_of(out, shape, topo)
    contiguous = [r for r in out["rows"] if r["placement"] == "contiguous"]
    rows, notes = folded_rows(out["rows"], placements, uniform=True)
    assert rows == [{**r, "placement": "contiguous=tree_prefix=round_robin"} for r in contiguous]
    (note,) = notes
    assert note.startswith("contiguous=tree_prefix=round_robin stands for contiguous, tree_prefix and round_robin, "
                           "shown once with contiguous's numbers"), note
    assert "contiguous and tree_prefix put every expert on the same rank" in note
    assert "under uniform routing the bytes depend only on how many experts each rank holds (2 on every rank" in note
    rows, notes = folded_rows(out["rows"], placements, uniform=False)
    assert list(dict.fromkeys(r["placement"] for r in rows)) == ["contiguous=tree_prefix", "round_robin"]
    assert notes == ["contiguous=tree_prefix stands for contiguous and tree_prefix, shown once with contiguous's "
                     "numbers: contiguous and tree_prefix put every expert on the same rank"]


def test_the_plan_says_why_rows_agree_and_only_when_they_do(capsys):
    from dist_moe.cli import main
    from dist_moe.cli.plan import why_rows_agree

    base = ["plan", "--topology", "node=4,gpu=8", "--hidden", "512", "--ffn", "256", "--experts", "32",
            "--top-k", "4", "--tokens-per-rank", "256", "--pipeline-chunks", "1"]
    assert main(base) == 0  # 32 experts on 32 ranks, uniform routing: one placement, rank = none
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 2 and "contiguous, round_robin and tree_prefix put every expert on the same rank" in notes[0]
    assert "32 experts on 32 ranks is one expert per rank" in notes[1], notes
    assert main([*base, "--ep", "8"]) == 0  # 4 experts per rank: rank dedup saves bytes, no note about it
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert not [n for n in notes if "dedup rank" in n], notes
    assert len(notes) == 1 and "each rank holds (4 on every rank here)" in notes[0], notes
    # a recorded routing's placements, shown apart, that move the same bytes get a note; planted: rows that
    # differ by placement get none, nor do uniform routing's (the fold's note says why)
    row = {"dedup": "rank", "chunks": 1, "bytes_per_token_by_level": {"node": 100.0, "gpu": 10.0}}
    rows = [{**row, "placement": "contiguous"},
            {**row, "placement": "round_robin", "bytes_per_token_by_level": {"node": 100.5, "gpu": 10.0}}]
    assert "the recorded routing's co-activation does not favour one placement" in why_rows_agree(rows, 32, 8,
                                                                                                   "runs/a")[0]
    assert why_rows_agree(rows, 32, 8, "uniform") == []
    rows[1]["bytes_per_token_by_level"] = {"node": 50.0, "gpu": 10.0}
    assert why_rows_agree(rows, 32, 8, "runs/a") == []


def test_every_ranks_ring_bytes_at_once_are_each_ranks_ring_sends():
    """The layouts' gradient sums, priced for every rank at once, send and receive per rank and level what
    ring_sends counts rank by rank (3 levels, chunks of unequal length)."""
    from placement.ep_groups import ring_sends
    from placement.layouts import layouts_of, ring_level_bytes

    topo = Topology(("rack", "node", "gpu"), (2, 2, 2))
    for layout in layouts_of(topo, 8):
        sent, recv = ring_level_bytes(layout, 1001)
        want_sent, want_recv = torch.zeros_like(sent), torch.zeros_like(recv)
        for ranks in layout.replica_groups():
            for position, rank in enumerate(ranks):
                level, nbytes = ring_sends(ranks, position, 1001, 4, topo)
                if level is not None:
                    want_sent[topo.levels.index(level), rank] += nbytes
                    want_recv[topo.levels.index(level), ranks[(position + 1) % len(ranks)]] += nbytes
        assert torch.equal(sent, want_sent) and torch.equal(recv, want_recv), (layout.ep_size, layout.layout)


def test_plan_prices_every_layout_with_its_gradient_sums_and_recommends_the_fastest_that_fits(capsys):
    from dist_moe.cli import main
    from placement.ep_groups import ExpertLayout, ring_allreduce_bytes
    from placement.layouts import expert_parameters, layouts_of, price_layouts

    topo = Topology(("node", "gpu"), (2, 2))
    assert [(x.ep_size, x.layout) for x in layouts_of(topo, 8)] == [(1, "contiguous"), (2, "contiguous"),
                                                                   (2, "strided"), (4, "contiguous")]
    shape = ModelShape(256, 1024, 8, 2, 256, layers=2)
    out = price_layouts(shape, topo, memory_bytes=1e12)
    for r in out["layouts"]:  # each layout's gradient bytes: a ring all-reduce of a rank's experts per replica group
        layout, want = ExpertLayout(topo, r["ep"], r["layout"]), {"node": 0, "gpu": 0}
        for group in layout.replica_groups():
            elements = 2 * 8 // r["ep"] * expert_parameters(shape)
            for level, b in ring_allreduce_bytes(group, elements, 4, topo).items():
                want[level] += b
        assert r["grad_bytes_by_level"] == want and (r["grad_seconds"] > 0) == (r["replicas"] > 1)
        assert r["step_seconds"] == pytest.approx(min(x["step_seconds"] for x in r["rows"]) + r["grad_seconds"])
    steps = [r["step_seconds"] for r in out["layouts"]]
    assert steps == sorted(steps) and out["recommended"] == out["layouts"][0]
    # memory: the layouts that hold too many experts per rank are not recommended
    tight = price_layouts(shape, topo, memory_bytes=16 * 2 * 2 * expert_parameters(shape))  # 2 experts x 2 layers
    assert tight["recommended"]["ep"] == 4 and all(not r["fits"] for r in tight["layouts"] if r["ep"] < 4)
    args = ["plan", "--topology", "node=2,gpu=2", "--hidden", "256", "--ffn", "1024", "--experts", "8", "--top-k", "2",
            "--tokens-per-rank", "256", "--layers", "2"]
    assert main(args) == 0
    text = capsys.readouterr().out
    best = out["recommended"]
    assert f"recommended: parallel.ep_size={best['ep']} parallel.ep_layout={best['layout']}" in text
    assert main([*args, "--memory", "0.001"]) == 0
    assert "recommended: none fits 0.001 GiB per rank (--memory)" in capsys.readouterr().out


def test_plan_takes_the_shape_a_train_config_trains(capsys):
    """--config prices the model a train config trains (each flag given changes it); without it the shape's
    flags are needed, and their absence is one line."""
    from dist_moe.cli import main

    common = ["plan", "--topology", "node=2,gpu=8", "--json", "--pipeline-chunks", "1"]
    assert main([*common, "--config", "configs/lm_branch.yaml"]) == 0
    from_config = json.loads(capsys.readouterr().out)
    # configs/lm_branch.yaml: d_model 64, ffn 128, E=8 top-2, 16 sequences x 64 tokens per rank, 2 layers,
    # train.precision auto: bf16, as the GPU cluster plan prices would train it
    flags = ["--hidden", "64", "--ffn", "128", "--experts", "8", "--top-k", "2", "--tokens-per-rank", "1024",
             "--layers", "2", "--dtype", "bf16"]
    assert main([*common, *flags]) == 0
    want = json.loads(capsys.readouterr().out)
    for out in (from_config, want):
        out.pop("seconds_to_plan")
    assert from_config == want and from_config["token_bytes"] == 64 * 2
    assert {(r["ep"], r["layout"]) for r in want["layouts"]} == {(1, "contiguous"), (2, "contiguous"),
                                                                  (2, "strided"), (4, "contiguous"),
                                                                  (4, "strided"), (8, "contiguous"), (8, "strided")}
    assert main([*common, "--config", "configs/lm_branch.yaml", "--experts", "16"]) == 0
    assert json.loads(capsys.readouterr().out)["layouts"][0]["memory_bytes"] != want["layouts"][0]["memory_bytes"]
    assert main(["plan", "--topology", "node=2,gpu=8", "--hidden", "64", "--experts", "8"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "dist-moe plan needs --ffn, --top-k, --tokens-per-rank (the model's shape), or --config with a train config "
        "that has it")


def test_groups_sharing_a_node_link_are_priced_on_their_share_of_it():
    """Every replica's group exchanges at once: EP 2 strided on 2 x 2 sends two groups through each node's one
    (shared) link, so each is priced on half its bandwidth; groups inside a node, the world's one group and
    private links keep the link whole."""
    from placement import CostModel
    from placement.ep_groups import ExpertLayout
    from placement.forecast import group_forecast
    from placement.layouts import group_links, price_layouts

    def two_by_two(shared: bool) -> Topology:
        cost = CostModel.default(["node", "gpu"]).updated({"node": {"shared": shared, "bandwidth_Bps": 1e9}})
        return Topology(("node", "gpu"), (2, 2), cost)

    shared = two_by_two(True)
    strided = group_links(ExpertLayout(shared, 2, "strided"))
    assert strided.sizes == (2, 1) and strided.cost.levels["node"].bandwidth_Bps == 5e8
    for layout in (ExpertLayout(shared, 2, "contiguous"), ExpertLayout(shared, 4)):
        assert group_links(layout).cost == shared.cost
    assert group_links(ExpertLayout(two_by_two(False), 2, "strided")).cost == two_by_two(False).cost
    shape = ModelShape(256, 128, 8, 2, 1024, 2, "fp32")
    priced = next(r for r in price_layouts(shape, shared)["layouts"] if (r["ep"], r["layout"]) == (2, "strided"))
    alone = group_forecast(shape, ExpertLayout(shared, 2, "strided").group_topology(0))["rows"]
    halved = group_forecast(shape, strided)["rows"]
    assert priced["moe_seconds"] == min(r["step_seconds"] for r in halved) > min(r["step_seconds"] for r in alone)
