"""`dist-moe report | place | simulate` on a run's recorded routing: files, exact bytes, speed."""
import importlib.util
import json
import time

import pytest
import torch

from dist_moe.cli import main
from placement import Placement, Topology, dispatch_traffic
from placement.simulate import RoutingRecord, replicas_for, simulate


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    import os

    base = tmp_path_factory.mktemp("report")
    os.environ["DIST_MOE_DATA"] = str(base / "data")
    try:
        assert main(["train", "--quiet", f"output.dir={base}/run", "train.epochs=2", "data.max_rows=2000"]) == 0
    finally:
        del os.environ["DIST_MOE_DATA"]
    return base / "run"


def test_run_records_its_routing(run_dir):
    record = RoutingRecord.load(run_dir)
    assert record.expert_idx.shape == (400, 4) and record.num_experts == 16 and record.token_bytes == 40
    assert bool((record.src_rank == 0).all())
    c = record.coactivation()
    assert torch.equal(c, c.t()) and int(c.diagonal().sum()) == int((record.expert_idx >= 0).sum())


def test_report_writes_files_with_exact_bytes(run_dir, capsys):
    assert main(["report", str(run_dir), "--topology", "node=2,gpu=2"]) == 0
    assert "report.md" in capsys.readouterr().out
    for name in ("report.json", "report.md", "traffic_heatmap.png", "bytes_by_level.png", "expert_load.png",
                 "tree_distance.png"):
        assert (run_dir / name).stat().st_size > 0, name
    report = json.loads((run_dir / "report.json").read_text())
    record = RoutingRecord.load(run_dir)
    topo = Topology(("node", "gpu"), (2, 2))
    src = torch.arange(400) % 4  # a one-process run: tokens dealt over the topology's ranks
    for dedup in ("none", "rank", "node"):
        expected = dispatch_traffic(record.expert_idx, src, Placement.contiguous(16, 4), topo, 40, dedup)
        got = report["placements"]["contiguous"]["modes"][dedup]["bytes_per_token_by_level"]
        assert got == {k: v / 400 for k, v in expected.by_level().items()}
    modes = report["placements"]["contiguous"]["modes"]
    node = [modes[d]["bytes_per_token_by_level"]["node"] for d in ("none", "rank", "node")]
    assert node[0] >= node[1] >= node[2] >= report["node_lower_bound_bytes_per_token"] > 0
    assert sum(report["expert_load"]) == int((record.expert_idx >= 0).sum())
    assert len(report["training"]["steps"]) == len(report["training"]["tree_distance"]) > 0


def test_place_writes_a_loadable_placement(run_dir, tmp_path, capsys):
    out = tmp_path / "placement.yaml"
    assert main(["place", "--topology", "node=2,gpu=2", "--stats", str(run_dir), "--out", str(out)]) == 0
    placement = Placement.from_yaml(out)
    placement.check(16, 4)
    printed = capsys.readouterr().out
    assert "saved" in printed
    # both partitions reported, every split: the heuristic's cut beside the exact one (proven at E=16);
    # without OR-Tools (the 'exact' extra) place says it used the heuristic alone
    splits = [line for line in printed.splitlines() if "heuristic" in line and "exact" in line]
    if importlib.util.find_spec("ortools") is None:
        assert not splits and "exact partition skipped" in printed
    else:
        assert [line.split()[:4] for line in splits] == [["node", "16", "experts", "into"]] + [
            ["gpu", "8", "experts", "into"]] * 2
        assert all("optimal" in line for line in splits)
    assert main(["place", "--topology", "node=2,gpu=2", "--stats", str(run_dir), "--out", str(out),
                 "--exact-seconds", "0"]) == 0
    assert "exact" not in capsys.readouterr().out


def test_simulate_1024_gpus_in_under_a_minute(run_dir, capsys):
    start = time.time()
    assert main(["simulate", "--nodes", "128", "--gpus-per-node", "8", "--stats", str(run_dir), "--json"]) == 0
    assert time.time() - start < 60
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 1024 and out["experts_simulated"] == 1024 and out["replicas"] == 64
    node = [out["modes"][d]["bytes_per_token_by_level"]["node"] for d in ("none", "rank", "node")]
    assert node[0] >= node[1] >= node[2] > 0


def test_simulation_keeps_recorded_co_selection_inside_replica_blocks():
    record = RoutingRecord(torch.tensor([[0, 1], [2, 3]]), torch.zeros(2, dtype=torch.long), 4, 1, 8)
    assert replicas_for(4, 16) == 4 and replicas_for(16, 24) == 3
    topo = Topology(("node", "gpu"), (2, 4))
    out = simulate(record, topo, "contiguous", tokens_per_rank=50)
    # 8 experts on 8 ranks, one each: pairs {0,1} and {2,3} (+4 per block) never share a rank,
    # and both stay inside one node of 4 experts: no copy crosses nodes with node dedup beyond one
    assert out["experts_simulated"] == 8
    assert out["modes"]["node"]["bytes_per_token_by_level"]["node"] <= 8


def test_report_errors_name_the_problem(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "routing.npz" in capsys.readouterr().err


def test_report_bytes_equal_the_bytes_the_run_measured(tmp_path):
    """4 ranks as 2 nodes x 2 under torchrun, node dedup, experts placed by a placement file: the report
    shows that placement first, as the run's (in its heatmap too), on the run's own topology, and its
    analytic bytes for the run's placement and dedup equal what the dispatcher measured sending those tokens."""
    import os
    import subprocess
    from pathlib import Path

    from tests.support.dist_utils import free_port

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    placement = Placement((torch.randperm(16, generator=torch.Generator().manual_seed(0)) // 4).tolist(), 4)
    placement.to_yaml(tmp_path / "placement.yaml")
    env = {**os.environ, "DIST_MOE_DATA": str(tmp_path / "data"), "OMP_NUM_THREADS": "1",
           "DIST_MOE_TOPOLOGY": "node=2,gpu=2"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([str(root / "launch/torchrun.sh"), "--nproc", "4", "--port", str(free_port()), "--quiet",
                           f"output.dir={out}", "data.max_rows=1500", "train.epochs=1", "parallel.dedup=node",
                           f"parallel.placement={tmp_path / 'placement.yaml'}"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "each node's share of the router's validation load, before capacity drops" in proc.stdout
    assert main(["report", str(out)]) == 0  # the run's own topology, recorded with its routing
    report = json.loads((out / "report.json").read_text())
    assert list(report["placements"])[0] == report["run_placement_shown"] == "placement.yaml"
    assert report["placements"]["placement.yaml"]["expert_to_rank"] == placement.expert_to_rank
    assert report["heatmap"]["placement"] == "placement.yaml" and "(the run's)" in report["heatmap"]["title"]
    assert "| 0 | placement.yaml (*run*) | node |" in (out / "report.md").read_text()
    run = report["run_dispatch"]
    assert report["topology"] == "node=2,gpu=2" and run["dedup"] == "node"
    assert report["topology_source"] == "the run's own, recorded with its routing"
    assert run["measured_bytes_by_level"] == run["analytic_bytes_by_level"]
    assert run["measured_bytes_by_level"]["node"] > 0
    # the run's own layout against the flat one on the same routing, as report prints and report.md says
    record = RoutingRecord.load(out)
    src = record.src_rank
    against, modes = report["run_against_flat"], report["placements"]
    assert (against["placement"], against["dedup"], against["level"]) == ("placement.yaml", "node", "node")
    assert against["bytes_per_token"] == modes["placement.yaml"]["modes"]["node"]["bytes_per_token_by_level"]["node"]
    flat = dispatch_traffic(record.expert_idx, src, Placement.contiguous(16, 4), Topology(("node", "gpu"), (2, 2)),
                            record.token_bytes, "none")
    assert against["flat_bytes_per_token"] == flat.by_level()["node"] / len(src) > against["bytes_per_token"]
    md = (out / "report.md").read_text()
    assert f"({against['ratio']:.2f}x)" in md and "bytes crossing the gpu level inside a node rise" in md


def _calibration(path, sizes=(2, 2), node_Bps=50e6):
    """A topology YAML as `dist-moe calibrate` writes it, with a slow (400 mbit-like) node link."""
    import yaml

    from placement.calibrate import to_yaml

    topo = Topology(("node", "gpu"), sizes)
    cost = topo.cost.updated({"node": {"bandwidth_Bps": node_Bps, "alpha_s": 1e-4}})
    path.write_text(yaml.safe_dump(to_yaml(topo, cost), sort_keys=False))
    return Topology.from_yaml(path)


def _estimate(report, placement="contiguous", dedup="rank"):
    return report["placements"][placement]["modes"][dedup]["estimated_seconds"]


def test_report_prices_exchanges_on_the_run_calibration_or_says_they_are_defaults(run_dir, tmp_path, capsys):
    """No calibration: the time column says it prices the default link rates and names them; a calibration
    given with --topology, or saved in the run directory, prices the exchanges with its fitted links."""
    assert main(["report", str(run_dir), "--topology", "node=2,gpu=2"]) == 0
    default = json.loads((run_dir / "report.json").read_text())
    md = (run_dir / "report.md").read_text()
    assert default["link_rates"]["default"] and "est. all-to-all (default link rates)" in md
    assert "default link rates (node 25 GB/s per rank, 10 us per peer; gpu 150 GB/s per rank" in md
    assert "dist-moe calibrate" in md and "default link rates" in capsys.readouterr().out

    calibrated = _calibration(tmp_path / "cal.yaml")
    assert main(["report", str(run_dir), "--topology", str(tmp_path / "cal.yaml")]) == 0
    report = json.loads((run_dir / "report.json").read_text())
    md = (run_dir / "report.md").read_text()
    record = RoutingRecord.load(run_dir)
    traffic = dispatch_traffic(record.expert_idx, torch.arange(400) % 4, Placement.contiguous(16, 4), calibrated, 40,
                               "rank")
    assert _estimate(report) == calibrated.cost.estimate(traffic, "rank") > 10 * _estimate(default)
    assert not report["link_rates"]["default"] and report["link_rates"]["source"].startswith("calibrated 20")
    assert "est. all-to-all (calibrated)" in md and "node 50 MB/s per rank, 100 us per peer" in md
    assert "calibrated" in capsys.readouterr().out

    own = run_dir / "calibrated_topology.yaml"  # the run's calibration, found beside its routing
    own.write_bytes((tmp_path / "cal.yaml").read_bytes())
    try:
        for args, source in (([], f"the run's calibration ({own})"), (["--topology", "node=2,gpu=2"], "given")):
            assert main(["report", str(run_dir), *args]) == 0
            report = json.loads((run_dir / "report.json").read_text())
            assert _estimate(report) == calibrated.cost.estimate(traffic, "rank"), args
            assert str(own) in report["link_rates"]["source"] and report["topology_source"].startswith(source)
        assert main(["report", str(run_dir), "--topology", "node=4,gpu=1"]) == 0  # another shape: not its links
        assert json.loads((run_dir / "report.json").read_text())["link_rates"]["default"]
    finally:
        own.unlink()
    capsys.readouterr()


def test_report_says_when_its_topology_is_assumed(run_dir, capsys):
    """A one-process run records no topology: the report says the 2 x 2 it uses is assumed and how to give
    the real one; a given one is called given."""
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    report = json.loads((run_dir / "report.json").read_text())
    md = (run_dir / "report.md").read_text()
    assert report["topology"] == "node=2,gpu=2" and report["topology_source"].startswith("assumed")
    for text in (out, md):
        assert "assumed, as the run (1 process) recorded none" in text and "--topology node=N,gpu=G" in text
    assert main(["report", str(run_dir), "--topology", "node=2,gpu=2"]) == 0
    assert "assumed" not in capsys.readouterr().out
    assert json.loads((run_dir / "report.json").read_text())["topology_source"] == "given (--topology node=2,gpu=2)"


def test_every_cost_command_takes_a_topology_file(run_dir, tmp_path, capsys):
    """calibrate's YAML is read by plan, simulate, report and place alike; simulate prices its exchanges
    with the file's links, at the file's sizes or at --nodes x --gpus-per-node."""
    cal = str(tmp_path / "cal.yaml")
    calibrated = _calibration(tmp_path / "cal.yaml")
    assert main(["report", str(run_dir), "--topology", cal]) == 0
    assert main(["place", "--topology", cal, "--stats", str(run_dir), "--out", str(tmp_path / "p.yaml"),
                 "--exact-seconds", "0"]) == 0
    assert main(["plan", "--topology", cal, "--hidden", "10", "--ffn", "8", "--experts", "16", "--top-k", "4",
                 "--tokens-per-rank", "32", "--sample", "64"]) == 0
    capsys.readouterr()
    assert main(["simulate", "--topology", cal, "--stats", str(run_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 4 and out["topology"] == "node=2,gpu=2"
    assert out["link_rates"]["source"].startswith("calibrated") and "node 50 MB/s" in out["link_rates"]["levels"]
    assert main(["simulate", "--topology", cal, "--nodes", "8", "--gpus-per-node", "2", "--stats", str(run_dir),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 16 and not out["link_rates"]["default"]
    assert main(["simulate", "--topology", "node=8,gpu=2", "--stats", str(run_dir)]) == 0
    assert "default link rates" in capsys.readouterr().out
    assert calibrated.cost != Topology(("node", "gpu"), (8, 2)).cost
    for args, says in ((["--topology", cal, "--racks", "2", "--nodes", "2", "--gpus-per-node", "2"], "levels"),
                       ([], "--topology node=N,gpu=G"), (["--nodes", "2"], "--gpus-per-node"),
                       (["--topology", str(tmp_path / "none.yaml")], "none.yaml")):
        assert main(["simulate", *args, "--stats", str(run_dir)]) == 2, args
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err


def test_report_shows_every_layer_and_the_summary_says_it_averages(tmp_path, capsys):
    """Two MoE layers that route differently: the report prints each layer's node share and tree distance
    (not layer 0's alone, unnamed); the training summary says its numbers are the mean over the layers,
    and which slots its node share counts."""
    from dist_moe.cli.train import print_summary as _print_summary

    RoutingRecord(torch.tensor([[0, 1], [0, 2], [3, 1], [3, -1]]), torch.arange(4), 4, 4, 16).save(tmp_path, 0)
    RoutingRecord(torch.tensor([[0, 1], [0, 1], [0, 1], [2, 3]]), torch.arange(4), 4, 4, 16).save(tmp_path, 1)
    assert main(["report", str(tmp_path), "--topology", "node=2,gpu=2"]) == 0
    out = capsys.readouterr().out
    md = (tmp_path / "report.md").read_text()
    assert "layer 0 contiguous 0.571 / 0.429" in md and "layer 1 contiguous 0.750 / 0.250" in md
    assert "after capacity drops" in md and "layer 0 0.833, layer 1 0.500" in md  # tree distances
    assert "layer 1 contiguous" in out
    _print_summary({"name": "lm", "router": "branch", "steps": 5, "seconds": 1.0, "output_dir": "runs/lm",
                    "val_loss": 2.0, "val_acc": 0.3, "val_load_cv": 0.2, "val_dropped_fraction": 0.0,
                    "val_node_share": [0.6, 0.4], "val_node_share_cv": 0.2, "val_layer0_load_cv": 0.1,
                    "val_layer1_load_cv": 0.3, "val_layer0_node_share": [0.5, 0.5],
                    "val_layer1_node_share": [0.7, 0.3]})
    printed = capsys.readouterr().out
    assert "mean over the 2 MoE layers" in printed and "val_layer<i>_* in runs/lm/summary.json" in printed
    assert "node share 0.600 / 0.400 (their CV 0.200): each node's share of the router's validation load, before " \
           "capacity drops" in printed
