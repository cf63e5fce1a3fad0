"""`dist-moe calibrate` on 2 gloo ranks writes a topology YAML that the planning commands read back
(the fit's numbers are the loopback's here; on the emulated cluster: benchmarks/dispatch_time.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


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
