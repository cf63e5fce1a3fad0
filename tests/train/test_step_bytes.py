"""The bytes a run logs and keeps are its training steps', exactly: no evaluation forward, no step lost.

Uniform routing is dense: under rank dedup every token crosses to the other rank once, so a run's
bytes are its trained tokens x the token's bytes, whatever the weights. Evaluation at every epoch's
end (which a log interval of 5 does not divide) would add the validation rows; bytes taken only at
log steps would lose the epochs' tails.
"""
import json
import os
from pathlib import Path

from tests.support.dist_utils import run_workers

D_MODEL = 16  # a token's row: 16 fp32 values
OVERRIDES = ["router.type=uniform", "router.num_experts=4", "router.top_k=4", f"model.d_model={D_MODEL}",
             "model.capacity_factor=null", "data.max_rows=600", "train.epochs=3", "train.batch_size=32",
             "train.log_every=5", "parallel.dedup=rank"]


def _train(rank, world, out_dir, data_dir):
    os.environ["DIST_MOE_DATA"] = data_dir
    from dist_moe.train.config import load_config
    from dist_moe.train.trainer import train

    summary = train(load_config(None, [*OVERRIDES, f"output.dir={out_dir}"]), quiet=True)
    Path(out_dir, f"summary.rank{rank}.json").write_text(json.dumps(summary))


def test_logged_and_kept_bytes_are_the_training_steps(tmp_path):
    out = tmp_path / "run"
    run_workers(_train, 2, args=(str(out), str(tmp_path / "data")), timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    for rank in range(2):  # every rank trained the same run
        assert json.loads((out / f"summary.rank{rank}.json").read_text())["steps"] == summary["steps"]
    expected = summary["samples"] * D_MODEL * 4  # each token once to the other rank
    assert summary["samples"] == 3 * 480 and summary["steps"] == 3 * 8  # 480 rows: 7 full steps and a half
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = sum(v for r in rows if "loss" in r for k, v in r.items() if k.startswith("bytes_"))
    assert logged == expected
    kept = json.loads((out / "train_traffic.json").read_text())
    assert kept["steps"] == summary["steps"] and kept["dedup"] == "rank"
    (matrix,) = kept["layers"]
    # each rank sent its own tokens' rows: half of every global batch (32 of 64; the last 16 of 32)
    assert matrix == [[0, expected // 2], [expected // 2, 0]]
