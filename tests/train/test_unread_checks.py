"""A GPU's router input checks (kept on the device, ``Router.defer_checks`` here) end a run at the log step
after the bad input, with the CPU's line on the rank that saw it and that line, named by rank, on the others."""
import json
import os
from pathlib import Path

from tests.support.dist_utils import run_workers

OVERRIDES = ["router.type=switch", "router.num_experts=4", "model.d_model=16", "data.max_rows=600",
             "train.batch_size=32", "train.log_every=5", "train.max_steps=12", "parallel.ep_size=1"]
BAD_FORWARD = 2  # rank 1's third training forward: step 3, before the log step at 5


def _train(rank, world, out_dir, data_dir):
    os.environ["DIST_MOE_DATA"] = data_dir
    from dist_moe.moe.layer import MoELayer
    from dist_moe.routing.base import Router
    from dist_moe.train.config import load_config
    from dist_moe.train.trainer import train

    Router.defer_checks = True  # a GPU's path on the CPU: no check read in a forward
    if rank == 1:
        real = MoELayer.forward

        def forward(self, x, *args, **kwargs):
            if self.training and self.forwards == BAD_FORWARD:  # the layer's input turns NaN (not the data's)
                x = x * float("nan")
            return real(self, x, *args, **kwargs)

        MoELayer.forward = forward
    said, steps = None, None
    try:
        train(load_config(None, [*OVERRIDES, f"output.dir={out_dir}"]), quiet=True)
    except ValueError as e:
        said = str(e)
    rows = [json.loads(line) for line in Path(out_dir, "metrics.jsonl").read_text().splitlines()]
    steps = max((r["step"] for r in rows if "loss" in r), default=0)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"said": said, "logged_steps": steps}))


def test_a_bad_router_input_on_the_device_ends_the_run_at_the_next_log_step_on_every_rank(tmp_path):
    out = tmp_path / "run"
    run_workers(_train, 2, args=(str(out), str(tmp_path / "data")), timeout=300)
    told = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    line = "router input contains NaN or Inf in 32 of 32 tokens"  # rank 1's batch, all NaN
    assert told[1]["said"] == line and told[0]["said"] == f"rank 1: {line}", told
    assert all(t["logged_steps"] == 0 for t in told), told  # no metrics row for the steps it ended in
