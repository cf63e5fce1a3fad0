"""summary.json as a run writes it: its keys in one order, two-space JSON, null for what is not finite,
written by the main rank alone (every rank gets the same mapping back)."""
import json
import types

import torch

from dist_moe.train.config import load_config
from dist_moe.train.metrics.summary import SUMMARY_FILE, Trained, write_summary
from placement import Topology

EXPECTED = """{
  "name": "demo",
  "router": "branch",
  "engine": "torch",
  "world_size": 1,
  "ep_size": 1,
  "topology": "node=1,gpu=1",
  "steps": 40,
  "already_finished": false,
  "samples": 9600,
  "samples_this_run": 4800,
  "skipped_steps": 1,
  "seconds": 1.23,
  "train_seconds": 0.568,
  "exchange_wait_s": 0.012,
  "pipeline_chunks": 1,
  "val_loss": 0.5,
  "val_tree_distance": null,
  "random_pair_tree_distance": 0.8166666666666667,
  "output_dir": "OUT",
  "probe": 7
}
"""


def _runtime(is_main=True, replicas=1):
    return types.SimpleNamespace(engine=types.SimpleNamespace(name="torch"), world=1, ep_size=1, is_main=is_main,
                                 device=torch.device("cpu"), topology=lambda: Topology.launched(1),
                                 layout=types.SimpleNamespace(replicas=replicas, layout="strided"))


def _summary(out, rt, hf_model=None):
    trained = Trained(steps=40, already_finished=False, samples=9600, samples_this_run=4800, skipped_steps=1,
                      seconds=1.234, train_seconds=0.5678, exchange_wait_s=0.0123,
                      last_eval={"val_loss": 0.5, "val_tree_distance": float("nan")})
    layer = types.SimpleNamespace(router=types.SimpleNamespace(name="branch"), num_experts=16)
    tuner = types.SimpleNamespace(chosen=None, medians={})
    return write_summary(load_config(None, [f"output.dir={out}"]), rt, out, trained, tuner, layer, hf_model,
                         {"probe": 7})


def test_the_summary_file_is_written_as_a_run_writes_it(tmp_path):
    summary = _summary(tmp_path, _runtime())
    assert (tmp_path / SUMMARY_FILE).read_text() == EXPECTED.replace("OUT", str(tmp_path))
    assert summary == json.loads(EXPECTED.replace("OUT", str(tmp_path)))


def test_replicas_and_an_exported_model_are_named_and_only_the_main_rank_writes(tmp_path):
    summary = _summary(tmp_path, _runtime(is_main=False, replicas=2), hf_model=tmp_path / "hf_model")
    assert not (tmp_path / SUMMARY_FILE).exists()
    keys = list(summary)
    assert keys[keys.index("ep_size") + 1] == "ep_layout" and summary["ep_layout"] == "strided"
    assert keys[keys.index("output_dir") + 1] == "hf_model" and summary["hf_model"] == str(tmp_path / "hf_model")
