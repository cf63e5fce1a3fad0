"""train.resume refuses a config that would change the checkpoint's model: the checkpoint keeps the run's
whole config, and the resume compares it with the run's leaf by leaf, without parsing it again; a config
saved before a key existed resumes with that key at its default."""
import pytest

from dist_moe.cli import main
from dist_moe.train.checkpoint import store as checkpoint
from dist_moe.train.config import load_config, model_changes
from dist_moe.train.run_config import RunConfig

SMALL = ["data.max_rows=300", "router.num_experts=8", "router.top_k=2"]


@pytest.fixture(autouse=True)
def _data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path / "data"))


def test_a_checkpoint_keeps_the_whole_config(tmp_path):
    overrides = [*SMALL, f"output.dir={tmp_path}", "train.max_steps=2", "train.checkpoint_every=2"]
    assert main(["train", "--quiet", *overrides]) == 0
    saved = checkpoint.saved_config(checkpoint.latest(tmp_path / "checkpoints"))
    assert saved["train"]["precision"] == "fp32"  # train.precision: auto, as it resolved on this CPU
    cfg = load_config(None, [*overrides, "train.precision=fp32"])
    assert saved == checkpoint.as_saved(cfg.to_dict(full=True))
    assert saved["router"]["ema_decay"] == 0.99  # a router key at its default is kept too
    assert model_changes(saved, cfg) == []


def test_the_saved_config_is_compared_without_parsing_it_again(monkeypatch):
    cfg = load_config(None, SMALL)
    saved = checkpoint.as_saved(cfg.to_dict(full=True))
    monkeypatch.setattr(RunConfig, "from_dict", classmethod(lambda *a, **k: pytest.fail("the schema ran again")))
    assert model_changes(saved, cfg) == []
    assert model_changes({**saved, "seed": 3}, cfg) == [("seed", 3, 0)]


def test_a_checkpoint_from_before_a_key_existed_resumes_with_its_default():
    """Older checkpoints kept a router's non-default keys only, and no layer options: what they lack counts
    as its default, so such a run resumes, and a run that sets the key otherwise is refused."""
    cfg = load_config(None, ["router.type=switch", *SMALL])
    old = cfg.to_dict()
    assert "jitter_eps" not in old["router"]  # at its default: not saved then
    for key in ("shared_expert_hidden", "lora_rank", "lora_alpha"):
        del old["model"][key]
    assert model_changes(old, cfg) == []
    lora = load_config(None, ["router.type=switch", *SMALL, "model.expert_type=lora", "model.lora_rank=4"])
    assert model_changes({**old, "model": {**old["model"], "expert_type": "lora"}}, lora) == \
        [("model.lora_rank", 8, 4)]
    assert model_changes(old, load_config(None, ["router.type=switch", *SMALL, "router.jitter_eps=0.5"])) == \
        [("router.jitter_eps", 0.01, 0.5)]


def test_a_saved_config_this_release_would_refuse_is_compared_as_written():
    cfg = load_config(None, SMALL)
    saved = checkpoint.as_saved(cfg.to_dict(full=True))
    assert model_changes({**saved, "model": {**saved["model"], "ffn_hidden_size": 0}}, cfg) == \
        [("model.ffn_hidden_size", 0, 32)]
    gone = model_changes({**saved, "router": {"type": "retired", "num_experts": 8}}, cfg)
    assert ("router.type", "retired", "branch") in gone and ("router.top_k", None, 2) in gone


def test_the_engines_own_keys_are_compared_only_for_that_engine():
    ds = load_config(None, [*SMALL, "engine=deepspeed", "model.capacity_factor=null", "train.precision=bf16"])
    saved = checkpoint.as_saved({**ds.to_dict(full=True), "train": {**ds.to_dict()["train"], "precision": "fp32"}})
    assert model_changes(saved, ds) == [("train.precision", "fp32", "bf16")]
    torch_run = load_config(None, [*SMALL, "model.capacity_factor=null", "train.precision=bf16"])
    assert model_changes(saved, torch_run) == []  # torch's weights are fp32 under either precision
