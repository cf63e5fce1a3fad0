"""model.kind hf takes its defaults from the model, not from the embedded tabular demo: no dist-moe router and
no capacity recorded, the run named after the model's folder, a batch of about 2,048 tokens; what the user gave
is kept, and a router key is refused naming where it was given. Its summary prints only what applies."""
import pytest
import torch
import yaml

from dist_moe.cli.train import print_summary
from dist_moe.train.config import load_config
from dist_moe.train.metrics.routing import layers_metrics, load_cv

HF = ["model.kind=hf", "model.path=models/qwen3-tiny/", "data.name=mine.txt"]


def test_a_users_model_from_overrides_alone_records_what_trains():
    cfg = load_config(None, HF)
    assert cfg.router is None and cfg.model.capacity_factor is None
    assert cfg.train.batch_size == 2048 // 64 and cfg.name == "qwen3-tiny+data.name=mine.txt"
    assert load_config(None, [*HF, "data.seq_len=512"]).train.batch_size == 4
    saved = cfg.to_dict()
    assert saved["router"] is None and saved["model"]["capacity_factor"] is None


def test_what_the_user_gave_is_kept_and_the_saved_config_loads_again(tmp_path):
    cfg = load_config(None, [*HF, "name=mine", "train.batch_size=3"])
    assert (cfg.name, cfg.train.batch_size) == ("mine", 3)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    assert load_config(path, []) == cfg


@pytest.mark.parametrize("given,named", [
    (["router.top_k=1"], "router.top_k (given by override 'router.top_k=1')"),
    (["router.type=switch"], "router.type (given by override 'router.type=switch')"),
])
def test_a_router_key_is_refused_naming_the_override_that_gave_it(given, named):
    with pytest.raises(ValueError) as e:
        load_config(None, [*HF, *given])
    assert str(e.value).startswith(named) and "the model's own router" in str(e.value)


def test_a_router_section_in_a_file_and_a_capacity_are_refused_naming_them(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("router: {type: branch, num_experts: 8}\n")
    with pytest.raises(ValueError, match=r"^router.num_experts \(given by config file '.*run.yaml'\)"):
        load_config(path, HF)
    with pytest.raises(ValueError, match=r"^model.capacity_factor=1.25: model.kind=hf trains .* dropless"):
        load_config(None, [*HF, "model.capacity_factor=1.25"])
    with pytest.raises(ValueError, match=r"^config key 'router' must be a mapping with a 'type' \(null only"):
        load_config(None, ["router=null"])


def test_the_summary_of_a_users_model_prints_its_router_and_no_tree_distance(capsys):
    base = {"name": "qwen3-tiny", "steps": 2, "seconds": 1.0, "output_dir": "OUT", "val_loss": 2.0,
            "val_tree_distance": 0.7}
    print_summary({**base, "router": "Qwen3MoeTopKRouter", "num_experts": 8, "top_k": 2,
                   "random_pair_tree_distance": None})
    out = capsys.readouterr().out
    assert "router=Qwen3MoeTopKRouter (8 experts, top-2: the model's own router)" in out
    assert "tree distance" not in out
    print_summary({**base, "router": "branch", "random_pair_tree_distance": 0.8})
    assert "tree distance 0.700" in capsys.readouterr().out


def test_the_node_share_cv_of_several_layers_is_the_cv_of_the_shares_printed_beside_it():
    layers = [{"load_cv": 0.1, "node_share": [0.6, 0.4], "node_share_cv": 0.2},
              {"load_cv": 0.3, "node_share": [0.3, 0.7], "node_share_cv": 0.4}]
    out = layers_metrics(layers)
    assert out["node_share"] == pytest.approx([0.45, 0.55])
    assert out["node_share_cv"] == pytest.approx(load_cv(torch.tensor([0.45, 0.55])))  # 0.1, not 0.3
    assert (out["layer0_node_share_cv"], out["layer1_node_share_cv"]) == (0.2, 0.4)
