"""A training run's MoE layers come from its config in one place (train/layer_config.py): every
MoELayerConfig field has a run-config key, the keys default to the layer's own defaults, and a key the
run's layers would not read is refused at load, in one line."""
import datetime
import types
from dataclasses import fields

import pytest

from dist_moe.cli import main
from dist_moe.dispatch.exchange import ExchangeConfig
from dist_moe.moe.layer import MoELayerConfig
from dist_moe.train.build import data_and_model
from dist_moe.train.config import load_config
from dist_moe.train.layer_config import layer_config
from dist_moe.train.run_config import ModelConfig

# each MoELayerConfig field and ExchangeConfig field -> the run-config key that sets it, with a value other than
# its default (hidden_size and router: the model's width and the run's router, given by the model being built)
LAYER_KEYS = {"ffn_hidden_size": ("model.ffn_hidden_size", 48), "capacity_factor": ("model.capacity_factor", 2.0),
              "shared_expert_hidden": ("model.shared_expert_hidden", 16), "expert_type": ("model.expert_type", "lora"),
              "lora_rank": ("model.lora_rank", 4), "lora_alpha": ("model.lora_alpha", 2.0)}
EXCHANGE_KEYS = {"dedup": ("parallel.dedup", "node"), "pipeline_chunks": ("parallel.pipeline_chunks", 3),
                 "deterministic": ("train.deterministic", True), "timeout": ("parallel.timeout_s", 77.0),
                 "wire_dtype": ("parallel.wire_dtype", "bf16")}
GIVEN_BY_THE_MODEL = {"hidden_size", "router"}


@pytest.fixture(autouse=True)
def _data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path / "data"))


def test_every_layer_field_is_set_from_the_run_config():
    """A field MoELayerConfig or ExchangeConfig gains without a run-config key, or a key layer_config drops,
    fails here."""
    assert {f.name for f in fields(MoELayerConfig)} == set(LAYER_KEYS) | GIVEN_BY_THE_MODEL | {"exchange"}
    assert {f.name for f in fields(ExchangeConfig)} == set(EXCHANGE_KEYS)
    cfg = load_config(None, [f"{key}={value}" for key, value in (*LAYER_KEYS.values(), *EXCHANGE_KEYS.values())])
    layer = layer_config(cfg, 24, cfg.router)
    assert (layer.hidden_size, layer.router) == (24, cfg.router)
    for name, (key, value) in LAYER_KEYS.items():
        assert getattr(layer, name) == value, key
    for name, (key, value) in EXCHANGE_KEYS.items():
        expected = datetime.timedelta(seconds=value) if name == "timeout" else value
        assert getattr(layer.exchange, name) == expected, key


def test_the_model_keys_default_to_the_layers_own_defaults():
    """One set of defaults: MoELayerConfig's. The run's capacity factor alone differs: the embedded default, the
    shipped configs and the recorded experiments train the BRANCH paper's 1.25 (the layer: dropless)."""
    layer = {f.name: f.default for f in fields(MoELayerConfig)}
    model = {f.name: f.default for f in fields(ModelConfig)}
    for name in set(LAYER_KEYS) - {"ffn_hidden_size", "capacity_factor"}:  # the layer requires ffn_hidden_size
        assert model[name] == layer[name], name
    assert (layer["capacity_factor"], model["capacity_factor"]) == (None, 1.25)


def test_the_options_reach_the_built_layer():
    cfg = load_config(None, ["data.max_rows=300", "model.shared_expert_hidden=8", "model.expert_type=lora",
                             "model.lora_rank=2", "model.lora_alpha=3.0"])
    _, model = data_and_model(cfg, types.SimpleNamespace(world=1, ep_size=1, build_moe=lambda c: c.build()))
    assert model.moe.shared_expert is not None and model.moe.shared_expert.inner.w_up.shape[-1] == 8
    assert model.moe.experts.kind == "lora" and model.moe.experts.lora_A.shape[-1] == 2
    assert model.moe.experts.lora_scale == 1.5


def test_the_runtime_exchanges_as_the_layers_do():
    from dist_moe.train.runtime import Runtime

    cfg = load_config(None, ["parallel.device=cpu", "parallel.timeout_s=60", "train.deterministic=true"])
    rt = Runtime(cfg.engine, cfg.parallel, deterministic=True)
    try:
        assert rt.exchange == layer_config(cfg, 8, cfg.router).exchange
    finally:
        rt.shutdown()


@pytest.mark.parametrize("args, says", [
    (["model.shared_expert_hidden=-1"], "config key 'model.shared_expert_hidden' must be an int >= 0"),
    (["model.shared_expert_hidden=2.5"], "got 2.5"),
    (["model.lora_rank=0"], "config key 'model.lora_rank' must be a positive int, got 0"),
    (["model.lora_alpha=0"], "config key 'model.lora_alpha' must be a finite number > 0, got 0"),
    (["model.lora_alpha=.inf"], "'model.lora_alpha'"),
    (["model.lora_rank=4"], "model.lora_rank=4 is read by model.expert_type=lora only (model.expert_type is "
                            "'swiglu')"),
    (["engine=deepspeed", "model.capacity_factor=null", "model.shared_expert_hidden=8"],
     "model.shared_expert_hidden=8: engine deepspeed's MoE layer holds no shared expert"),
    (["engine=megatron", "model.capacity_factor=null", "model.shared_expert_hidden=8"],
     "engine megatron's MoE layer holds no shared expert"),
    (["engine=megatron", "model.capacity_factor=null", "model.expert_type=lora"],
     "model.expert_type=lora: engine megatron's experts are Megatron-core's MLPs (swiglu, gelu)"),
    (["model.kind=hf", "model.path=/nonexistent", "model.shared_expert_hidden=8"],
     "model.shared_expert_hidden=8 shapes dist-moe's own MoE layers; model.kind=hf trains the model's own experts"),
])
def test_a_layer_key_the_run_cannot_honour_is_one_line_and_exit_2(tmp_path, capsys, args, says):
    assert main(["train", "--quiet", f"output.dir={tmp_path / 'run'}", "train.max_steps=1", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dist-moe: error: ") and says in err[0], err
    assert not (tmp_path / "run").exists()  # refused at load, before anything was made


def test_the_engines_take_what_they_build():
    assert load_config(None, ["engine=deepspeed", "model.capacity_factor=null", "model.expert_type=lora",
                              "model.lora_rank=4"]).model.lora_rank == 4
    assert load_config(None, ["engine=megatron", "model.capacity_factor=null", "model.expert_type=gelu"])
