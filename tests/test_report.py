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
    """4 ranks as 2 nodes x 2 under torchrun, node dedup: the report's analytic bytes for the run's
    own placement and dedup equal what the dispatcher measured sending those tokens."""
    import os
    import subprocess
    from pathlib import Path

    from tests.dist_utils import free_port

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    env = {**os.environ, "DIST_MOE_DATA": str(tmp_path / "data"), "OMP_NUM_THREADS": "1",
           "DIST_MOE_TOPOLOGY": "node=2,gpu=2"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([str(root / "launch/torchrun.sh"), "--nproc", "4", "--port", str(free_port()), "--quiet",
                           f"output.dir={out}", "data.max_rows=1500", "train.epochs=1", "parallel.dedup=node",
                           "parallel.placement=tree_prefix"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main(["report", str(out)]) == 0  # the run's own topology, recorded with its routing
    report = json.loads((out / "report.json").read_text())
    run = report["run_dispatch"]
    assert report["topology"] == "node=2,gpu=2" and run["dedup"] == "node"
    assert run["measured_bytes_by_level"] == run["analytic_bytes_by_level"]
    assert run["measured_bytes_by_level"]["node"] > 0
