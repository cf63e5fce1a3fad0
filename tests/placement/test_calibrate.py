"""`dist-moe calibrate` on 2 gloo ranks writes a topology YAML that the planning commands read back
(the fit's numbers are the loopback's here; on the emulated cluster: benchmarks/dispatch_time.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_calibrate_writes_a_topology_that_plan_reads(tmp_path, capsys):
    out = tmp_path / "calibrated.yaml"
    # --standalone: torchrun takes a free port itself (a port picked here first could be taken meanwhile)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dist_moe.cli", "calibrate",
           "--topology", "node=2,gpu=1", "--repeats", "3", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert r.returncode == 0, ([line for line in r.stderr.splitlines() if "dist-moe: error" in line], r.stderr[-2000:])
    assert f"wrote {out}" in r.stdout
    data = yaml.safe_load(out.read_text())
    assert data["levels"] == ["node", "gpu"] and data["sizes"] == [2, 1]
    assert data["cost"]["node"]["bandwidth_Bps"] > 0 and data["cost"]["node"]["shared"] is False  # 1 rank a node
    ex = data["exchange"]
    assert ex["latency_s"] > 0 and 0 <= ex["overlap"] <= 1 and ex["chunked"] > 0

    from dist_moe.cli import main

    assert main(["plan", "--topology", str(out), "--hidden", "64", "--ffn", "32", "--experts", "4", "--top-k", "2",
                 "--tokens-per-rank", "128", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["topology"] == "node=2,gpu=1" and {r["chunks"] for r in plan["rows"]} == {1, 4}


def test_calibrate_outside_a_launch_says_how_to_launch_it(capsys, monkeypatch):
    from dist_moe.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["calibrate"]) == 2
    err = capsys.readouterr().err.strip()
    assert "launcher" in err and len(err.splitlines()) == 1


def _calibrate_with(monkeypatch, seconds):
    """calibrate() on node=2,gpu=2 with each timed exchange taking the next of ``seconds`` (no process group)."""
    from placement import Topology
    from placement import calibrate as cal

    it = iter(seconds)
    monkeypatch.setattr(cal, "slowest_spread", lambda fn, repeats=5, group=None: cal.Spread.of([next(it)]))
    monkeypatch.setattr(cal, "slowest", lambda fn, repeats=5, group=None: next(it))
    monkeypatch.setattr(cal, "measure_overlap", lambda topology, repeats=5: (0.5, 1.0))
    return cal.calibrate(Topology(("node", "gpu"), (2, 2)))


# seconds: the one-byte latency, the node level's three sizes, its one-sender-per-node run, the gpu level's sizes
NODE = [20e-3, 100e-3, 200e-3, 100e-3]


def test_a_level_inside_a_node_faster_than_the_collective_latency_is_still_fitted(monkeypatch):
    """The one-byte exchange crosses the slow link, so a burst on it can outlast every exchange inside a node
    (seen on the emulated cluster: 4.6 ms against 1.3-5.5 ms); taking it off those left no growth to fit."""
    cost = _calibrate_with(monkeypatch, [6e-3, *NODE, 1.3e-3, 2.46e-3, 5.47e-3])
    gpu = cost.levels["gpu"]
    assert 0 < gpu.bandwidth_Bps < float("inf")
    assert cost.levels["node"].bandwidth_Bps < gpu.bandwidth_Bps


def test_a_level_whose_time_does_not_grow_names_it_and_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match=r"the gpu level's exchanges did not take longer with more bytes "
                                         r"\(2\.00, 1\.90, 1\.80 ms for 256 KiB, 1 MiB, 2 MiB per peer\).*--repeats"):
        _calibrate_with(monkeypatch, [1e-3, *NODE, 2e-3, 1.9e-3, 1.8e-3])


def test_the_latency_is_the_median_of_many_repeats_told_with_their_middle_half(monkeypatch):
    """The one-byte exchange on a busy machine: mostly 0.5 ms, 12 of its 40 repeats 5 ms, the first five after the
    warm-up among them. Their median alone (5 repeats) said 5 ms; 40 say 0.5 ms, and their middle half reaches 5."""
    from placement import CostModel, Topology
    from placement import calibrate as cal

    fast, slow = 0.5e-3, 5e-3
    samples = iter([9e-3] + [slow] * 5 + [slow, fast, fast] * 7 + [fast] * 14)  # a warm-up, then 40 repeats
    monkeypatch.setattr(cal, "slowest_once", lambda fn, group=None: next(samples))
    monkeypatch.setattr(cal, "_fit_levels", lambda topology, *rest: CostModel.default(topology.levels))
    monkeypatch.setattr(cal, "measure_overlap", lambda topology, repeats=5: (0.5, 1.0))
    fitted = cal.calibration(Topology(("node", "gpu"), (2, 1)), repeats=5)
    assert fitted.latency == cal.Spread(median=fast, low=fast, high=slow, repeats=40)
    assert fitted.cost.latency_s == fast
