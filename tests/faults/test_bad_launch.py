"""Bad configuration and launch: every rank stops at once with exit code 2 and an error naming the
bad value, before any training collective (no rank is left waiting for a peer)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_moe.train.step import engines
from placement import Placement
from tests.faults.launch import start_ranks, wait_all

BASE = ["data.max_rows=600", "train.max_steps=3", "router.num_experts=8", "router.top_k=2",
        "parallel.timeout_s=60"]


def _placement_file(tmp_path):
    path = tmp_path / "placement.yaml"
    Placement.contiguous(16, 2).to_yaml(path)  # for 16 experts: the run has 8
    return path


CASES = [
    ([], {"DIST_MOE_TOPOLOGY": "node=2,gpu=4"}, "topology node=2,gpu=4 has 8 ranks but WORLD_SIZE=2"),
    (["parallel.placement=PLACEMENT"], {}, "places 16 experts on 2 ranks, but this run has 8 experts on 2 ranks"),
    (["router.type=specdrop", "router.num_experts=3", "router.num_categories=4", "data.name=satimage",
      "data.categories=satimage_landcover"], {}, "router.num_categories=4"),
    (["router.type=specdrop"], {}, "set data.categories"),
    (["data.categories=no_such_set"], {}, "'no_such_set'"),
    (["train.lr_schedule=cosine"], {}, "unknown config key 'train.lr_schedule'"),
    (["engine=jax"], {}, "'engine' must be one of torch, deepspeed, megatron"),
]


@pytest.mark.parametrize("overrides, env, message", CASES, ids=[c[2][:30] for c in CASES])
def test_every_rank_stops_with_the_bad_value_named(tmp_path, overrides, env, message):
    overrides = [o.replace("PLACEMENT", str(_placement_file(tmp_path))) for o in overrides]
    start = time.monotonic()
    procs = start_ranks(2, [*BASE, *overrides], tmp_path, {"DIST_MOE_DATA": str(tmp_path / "data"), **env})
    codes = wait_all(procs, 60)
    took = time.monotonic() - start
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    assert codes == [2, 2], (codes, logs)
    for log in logs:
        assert message in log, log[-1500:]
        assert "a collective failed" not in log  # refused up front, not discovered by a peer's timeout
    print(f"\n{message[:40]!r}: both ranks exited 2 after {took:.1f} s (process start included)")
    assert took < 45, took  # far inside parallel.timeout_s=60: nobody waited for a peer


def test_bare_torchrun_reports_the_ranks_line_not_a_traceback(tmp_path):
    """Under torchrun itself (no launch script) each rank writes torchrun's error file
    (TORCHELASTIC_ERROR_FILE, in torch's ErrorHandler format), so the failure report shows our line as
    the rank's traceback. Before: `traceback : To enable traceback see: https://pytorch.org/...`.
    torchrun's own traceback (its ChildFailedError) above the report is torchrun's, and stays."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIST_MOE_DATA": str(tmp_path / "data"),
           "DIST_MOE_TOPOLOGY": "node=2,gpu=4"}
    for name in ("WORLD_SIZE", "RANK", "DIST_MOE_ERROR_DIR"):
        env.pop(name, None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "--log-dir", str(tmp_path / "torchrun"), str(Path(sys.executable).parent / "dist-moe"),
                        "train", "--quiet", f"output.dir={tmp_path / 'run'}", *BASE], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    message = "topology node=2,gpu=4 has 8 ranks but WORLD_SIZE=2"
    report = r.stderr[r.stderr.index("Root Cause (first observed failure):"):]
    assert "traceback : dist-moe: error" in report and message in report, r.stderr[-3000:]
    assert "To enable traceback" not in r.stderr
    ranks_lines = [line for line in r.stderr.splitlines() if line.startswith("dist-moe: error")]
    assert len(ranks_lines) >= 1 and all(message in line for line in ranks_lines)  # each one write, whole


def test_a_matching_placement_file_is_used(tmp_path):
    from dist_moe.train.config import load_config
    from dist_moe.train.trainer import train

    path = tmp_path / "p.yaml"
    Placement([0] * 8, 1).to_yaml(path)
    cfg = load_config(None, [*BASE, f"parallel.placement={path}", f"output.dir={tmp_path / 'run'}"])
    assert train(cfg, quiet=True)["steps"] == 3


def test_unsupported_engine_release_is_refused(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.18.3" if name == "deepspeed" else real(name))
    with pytest.raises(ValueError, match="deepspeed 0.18.3 is installed, but dist-moe supports 0.19.x only"):
        engines.check_engine_version("deepspeed")
    engines.check_engine_version("megatron")  # the installed 0.16.x passes
    engines.check_engine_version("torch")
