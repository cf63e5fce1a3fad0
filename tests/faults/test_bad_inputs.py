"""Hostile or damaged inputs end as one line naming the key or the file, exit code 2: YAML bombs, non-finite
numbers, sizes beyond memory, damaged data caches, routing records and placement or topology files."""
import types

import numpy as np
import pytest
import torch
import yaml

from dist_moe.cli import main
from dist_moe.data.corpus import load_corpus
from dist_moe.data.tabular import load_keel, tabular_split
from dist_moe.data.text_tasks import text_split
from dist_moe.errors import report
from dist_moe.moe.layer import MoELayer
from dist_moe.routing import build_router
from dist_moe.train.build import data_and_model
from dist_moe.train.config import load_config
from placement import Placement, Topology
from placement.simulate import RoutingRecord
from placement.subtree import level_depths
from tests.faults.test_user_errors import TINY


def _fails(capsys, *args, fragments=()) -> str:
    """main(args) exits 2 with one ``dist-moe: error:`` line holding every fragment, and no traceback."""
    code = main(list(args))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("dist-moe: error: "), err[:2000]
    assert "Traceback" not in err and "internal error" not in err, err
    for f in fragments:
        assert f in err, (f, err)
    return err


# --- YAML ---------------------------------------------------------------------------------------

def _laughs() -> str:
    """403 bytes that expand to 10^8 strings."""
    parts, prev = ['&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]'], "a"
    for name in "bcdefg":
        parts.append(f"&{name} [" + ",".join([f"*{prev}"] * 10) + "]")
        prev = name
    return "router: {type: branch, x: [" + ", ".join(parts) + ", [" + ",".join([f"*{prev}"] * 10) + "]]}\n"


@pytest.mark.parametrize("text,fragments", [
    ("name: " + "[" * 30000 + "]" * 30000 + "\n", ["nested deeper than 50 levels", "line 1"]),
    (_laughs(), ["aliases expand it to more than 1000000 values"]),
    ("name: a\nseed: 1\nname: b\n", ["duplicate key 'name'", "line 3"]),
    ("router:\n  type: branch\n  top_k: 2\n  top_k: 4\n", ["duplicate key 'top_k'", "line 4"]),
    ("router: &r {type: branch, x: *r}\n", ["an alias refers to the value that holds it"]),
    ("a0: &a0 [" + "[" * 40 + "]" * 40 + "]\n" + "".join(
        f"a{i}: &a{i} [[[[[[[[[[*a{i - 1}]]]]]]]]]]\n" for i in range(1, 10)), ["aliases nest it deeper than 50"]),
])
def test_hostile_yaml_is_refused_with_its_line(capsys, tmp_path, text, fragments):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    err = _fails(capsys, "train", "--config", str(path), fragments=[f"config file {str(path)!r}", *fragments])
    assert len(err) < 500


def test_a_huge_config_file_is_refused_unread(capsys, tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("name: demo\n" + "# padding\n" * 120_000)  # 1.2 MB
    _fails(capsys, "train", "--config", str(path), fragments=[str(path), "larger than 1 MiB"])


def test_an_override_obeys_the_same_limits(capsys):
    _fails(capsys, "train", "router.x=" + "[" * 5000 + "]" * 5000, fragments=["nested deeper than 50 levels"])


def test_a_huge_value_is_echoed_cut(capsys):
    with pytest.raises(ValueError) as e:
        load_config(None, ["seed=[" + ",".join(["1"] * 20_000) + "]"])
    assert "config key 'seed' must be" in str(e.value) and len(str(e.value)) < 300
    assert report(ValueError("x" * 10**7)) == 2
    assert len(capsys.readouterr().err) < 1100


# --- numbers in the config ------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,fragments", [
    (["model.capacity_factor=.inf"], ["'model.capacity_factor' must be a number in (0, 65536]"]),
    (["model.capacity_factor=1e308"], ["'model.capacity_factor' must be a number in (0, 65536]", "1e+308"]),
    (["parallel.timeout_s=1e15"], ["'parallel.timeout_s' must be a number of seconds in [1, 604800]"]),
    (["parallel.timeout_s=1e-300"], ["'parallel.timeout_s' must be a number of seconds in [1, 604800]"]),
    (["parallel.timeout_s=0.001"], ["'parallel.timeout_s' must be a number of seconds in [1, 604800]"]),
    (["parallel.dedup=node", "parallel.pipeline_chunks=100000000000000000000000000000"],
     ["'parallel.pipeline_chunks' must be an int in [1, 64]"]),
    (["parallel.pipeline_chunks=65"], ["'parallel.pipeline_chunks' must be an int in [1, 64] or auto, got 65"]),
    (["router.subtree_limit=1", "router.type=switch"],
     ["override 'router.type=switch' drops router.subtree_limit", "'router.subtree_limit=1'"]),
    (["router.type=switch", "router.subtree_limit=1"], ["unknown config key 'router.subtree_limit' for type"]),
    (["router.subtree_limit.node=1", "router={type: switch}"], ["drops router.subtree_limit"]),
    (["train.max_grad_norm=.inf"], ["'train.max_grad_norm' must be a finite number"]),
    (["train.lr=1e400"], ["'train.lr' must be a finite number"]),
    (["router.type=deepseek_v3", "router.bias_update_rate=.inf"], ["'router.bias_update_rate' must be a finite"]),
    (["router.type=skywork", "router.norm_scale=.inf"], ["'router.norm_scale' must be a finite number"]),
    (["router.eta=.nan"], ["'router.eta' must be a finite number, got nan"]),
    (["router.num_experts=0"], ["router.num_experts must be a positive int, got 0"]),
    (["router.top_k=99"], ["router.top_k must be an int in [1, num_experts=16]"]),
    (["router.foo=1"], ["unknown config key 'router.foo' for type 'branch'"]),
])
def test_bad_numbers_are_refused_with_the_config(capsys, tmp_path, overrides, fragments):
    with pytest.raises(ValueError) as e:  # by load_config itself: before any data, process group or run dir
        load_config(None, overrides)
    assert all(f in str(e.value) for f in fragments), str(e.value)
    _fails(capsys, "train", *overrides, f"output.dir={tmp_path / 'run'}", fragments=fragments)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides,fragments", [
    (["router.eta=0.5"], ["router.eta must be 0 or 1"]),
    (["router.num_experts=6", "router.top_k=2"], ["router.num_experts must be a power of two"]),
    (["router.node_map=mlp", "router.mlp_hidden=10000000000"], ["router.mlp_hidden=10000000000", "GiB", "available"]),
    (["router.subtree_limit=1", "router.subtree_depth=1", "router.subtree_balance=quantile"],
     ["router.subtree_balance", "must be one of none, bias", "'quantile'"]),
    (["router.subtree_balance=bias"], ["router.subtree_balance", "give subtree_limit"]),
    (["router.type=switch", "router.capacity_factor=1e308"], ["router.capacity_factor must be a number in (0, 65536]"]),
    (["router.subtree_limit=1", "router.subtree_depth=1", "router.balance_rate=-1"],
     ["router.balance_rate", "must be a number > 0"]),
])
def test_router_keys_found_at_build_time_name_the_config_key(capsys, tmp_path, overrides, fragments):
    _fails(capsys, "train", *TINY, *overrides, f"output.dir={tmp_path}", fragments=fragments)


def test_build_router_names_the_bare_key_for_its_own_callers():
    base = {"type": "skywork", "hidden_size": 4, "num_experts": 4}
    with pytest.raises(ValueError, match="^router key 'norm_scale' must be a finite number, got inf$"):
        build_router({**base, "norm_scale": float("inf")})
    with pytest.raises(ValueError, match="^num_experts must be a power of two >= 2 for BranchRouter"):
        build_router({"type": "branch", "hidden_size": 4, "num_experts": 6, "top_k": 2})
    with pytest.raises(ValueError, match=r"capacity_factor must be a number in \(0, 65536\]"):
        MoELayer(4, 8, {"type": "switch", "num_experts": 4}, capacity_factor=float("inf"))
    with pytest.raises(ValueError, match=r"pipeline_chunks must be an int in \[1, 64\], got 100000000000000000000"):
        MoELayer(4, 8, {"type": "switch", "num_experts": 4}, pipeline_chunks=10**20)


@pytest.mark.parametrize("overrides,fragments", [
    (["model.d_model=100000000000000000000000000000"], ["model.d_model=100000000000000000000000000000", "GiB"]),
    (["model.d_model=1000000000"], ["model.d_model=1000000000", "GiB per rank", "available"]),
    (["--config", "configs/lm_branch.yaml", "model.d_model=100000"], ["model.kind=lm", "model.d_model=100000", "GiB"]),
    (["--config", "configs/lm_branch.yaml", "model.layers=10000"], ["model.layers=10000", "GiB"]),
    (["train.batch_size=1000000000000"], ["train.batch_size=1000000000000", "GiB"]),
])
def test_model_sizes_beyond_memory_are_refused_before_allocating(capsys, tmp_path, monkeypatch, overrides, fragments):
    allocated = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    _fails(capsys, "train", *overrides, f"output.dir={tmp_path / 'run'}", fragments=fragments)
    assert not (tmp_path / "run").exists()
    assert all(np.prod(a[0] if a and isinstance(a[0], tuple) else a) < 10**8 for a in allocated), allocated[:3]


@pytest.mark.parametrize("overrides,fragments", [
    (["router.subtree_limit=100"], ["router key 'subtree_limit' allows 100 nodes, but the topology has 1"]),
    (["router.subtree_limit={node: 100}"], ["allows 100 nodes, but the topology has 1", "give at most 1"]),
    (["router.type=deepseek_v3", "router.node_limit=100"],
     ["router key 'node_limit' is 100, but the experts sit on 1 node(s)"]),
])
def test_a_node_limit_beyond_the_topology_is_refused(capsys, tmp_path, overrides, fragments):
    _fails(capsys, "train", *TINY, "--config", "configs/tabular_branch_limited.yaml", *overrides,
           f"output.dir={tmp_path / 'run'}", fragments=fragments)
    assert not (tmp_path / "run").exists()


def test_limits_beyond_a_two_node_topology_are_refused_and_within_it_accepted():
    levels, sizes = ("node", "gpu"), (2, 2)
    for limit in ({"node": 2}, {"node": 1, "gpu": 4}):  # as many units as there are: accepted
        level_depths(limit, levels, sizes, 8)
    for limit, units in (({"node": 3}, "2 nodes"), ({"gpu": 5}, "4 gpus")):
        with pytest.raises(ValueError, match=f"allows .* but the topology has {units.split()[0]}"):
            level_depths(limit, levels, sizes, 8)
    nodes = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    build_router({"type": "deepseek_v3", "hidden_size": 4, "num_experts": 8, "top_k": 2, "node_limit": 2}
                 ).set_expert_groups(nodes)
    with pytest.raises(ValueError, match="node_limit' is 3, but the experts sit on 2 node"):
        build_router({"type": "deepseek_v3", "hidden_size": 4, "num_experts": 8, "top_k": 2, "node_limit": 3}
                     ).set_expert_groups(nodes)


def test_an_override_can_switch_gar_off():
    assert load_config("configs/tabular_switch_gar.yaml").train.gar is not None
    assert load_config("configs/tabular_switch_gar.yaml", ["train.gar=null"]).train.gar is None
    again = load_config("configs/tabular_switch_gar.yaml", ["train.gar=null", "train.gar.lambda=0.5"])
    assert again.train.gar.lam == 0.5


# --- data -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def magic():
    x, y, classes = load_keel("magic")
    return {"x": x, "y": y, "classes": np.array(classes)}


def _plant(tmp_path, monkeypatch, arrays: dict, name="keel_magic.npz"):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path / "data"))
    (tmp_path / "data").mkdir(exist_ok=True)
    np.savez(tmp_path / "data" / name, **arrays)
    return tmp_path / "data" / name


def _column_3(x, values):
    x = x.copy()
    x[:, 3] = values
    return x


@pytest.mark.parametrize("change,fragments", [
    (lambda z: {**z, "y": z["y"] + 0.5}, ["'y' must be a 1-D integer array", "float64"]),
    (lambda z: {**z, "x": z["x"][:, 0].copy()}, ["'x' must be a 2-D numeric array, got a 1-D"]),
    (lambda z: {"x": z["x"], "y": z["y"]}, ["lacks the array 'classes'"]),
    (lambda z: {**z, "y": z["y"][:-5]}, ["arrays of different lengths"]),
    (lambda z: {**z, "x": z["x"][:3], "y": z["y"][:3]}, ["holds 3 rows; a run needs at least 10"]),
    (lambda z: {**z, "x": _column_3(z["x"], np.where(np.arange(len(z["x"])) % 2, -3e38, 3e38))},
     ["column 3: up to 3e+38", "overflow float32 when standardised"]),
    (lambda z: {**z, "x": _column_3(z["x"], np.where(np.arange(len(z["x"])) == 5, 3e38, 1.0))},
     ["column 3: up to 3e+38"]),
])
def test_a_damaged_table_names_the_file_and_what_is_wrong(capsys, tmp_path, monkeypatch, magic, change, fragments):
    path = _plant(tmp_path, monkeypatch, change(magic))
    with pytest.raises(ValueError) as e:
        tabular_split("magic")
    assert str(path) in str(e.value) and all(f in str(e.value) for f in fragments), str(e.value)
    # and through the command, one line: the user sees the same (on every row: the bad one is in the sample)
    _fails(capsys, "train", *TINY, "data.max_rows=null", f"output.dir={tmp_path / 'run'}",
           fragments=[str(path), *fragments])


def test_a_cache_that_is_no_npz_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path))
    (tmp_path / "keel_magic.npz").write_text("garbage\n")
    with pytest.raises(ValueError, match="keel_magic.npz is not an .npz archive"):
        tabular_split("magic")


def test_other_caches_missing_a_key_name_it(tmp_path, monkeypatch):
    _plant(tmp_path, monkeypatch, {"tokens": np.zeros((12, 65), np.uint8)}, "corpus_64_3_0.npz")
    with pytest.raises(ValueError, match="corpus_64_3_0.npz lacks the array 'domain'"):
        load_corpus(64, 3, 0)
    _plant(tmp_path, monkeypatch, {"y": np.zeros(4, np.int64)},
           "text_tasks_pos-lexname-verblex-source-domain_2_8_0.npz")
    with pytest.raises(ValueError, match="lacks the array 'x'"):
        text_split(2, 8, 0.2, 0)


def test_sequences_longer_than_the_data_or_the_model_are_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path / "data"))
    _fails(capsys, "train", "--config", "configs/lm_branch.yaml", "data.seq_len=10000000000",
           f"output.dir={tmp_path / 'lm'}", fragments=["data.seq_len=10000000000", "domain 'fortunes'", "at most"])
    with pytest.raises(ValueError, match="data.seq_len=100000: MiniLM reads at most 512 tokens"):
        text_split(10, 100000, 0.2, 0)


def test_every_rank_needs_a_training_row():
    cfg = load_config(None, ["data.max_rows=10", "router.num_experts=8", "router.top_k=2"])
    build = lambda config: config.build()  # noqa: E731
    data, _ = data_and_model(cfg, types.SimpleNamespace(world=8, ep_size=8, build_moe=build))
    assert len(data.x_train) == 8
    with pytest.raises(ValueError, match="leaves 8 training rows for 9 ranks"):
        data_and_model(cfg, types.SimpleNamespace(world=9, ep_size=9, build_moe=build))


# --- routing records, placements, topologies -----------------------------------------------------

def _record(tmp_path, **change):
    """A valid routing record of 8 experts (top-2, one rank, 40 B/token), with ``change`` planted."""
    import torch

    idx = torch.stack([torch.arange(30) % 8, (torch.arange(30) + 1) % 8], 1)
    RoutingRecord(idx, torch.zeros(30, dtype=torch.long), 8, 1, 40, probs=torch.full((30, 8), 0.125)).save(tmp_path)
    z = dict(np.load(tmp_path / "routing.npz"))
    for key, value in change.items():
        if value is None:
            del z[key]
        else:
            z[key] = value(z[key])
    np.savez(tmp_path / "routing.npz", **z)
    return tmp_path


def _at(i, j, v):
    def put(a):
        a = a.copy()
        a[(i, j) if j is not None else i] = v
        return a
    return put


@pytest.mark.parametrize("change,fragments", [
    ({"expert_idx": _at(3, 0, 99)}, ["expert_idx holds ids outside [-1, 8)", "max 99"]),
    ({"expert_idx": _at(3, 0, -7)}, ["expert_idx holds ids outside [-1, 8)", "min -7"]),
    ({"meta": _at(0, None, 0)}, ["num_experts (in 'meta') must lie in [1, 65536], got 0"]),
    ({"meta": _at(0, None, 2**40)}, ["num_experts (in 'meta') must lie in [1, 65536], got 1099511627776"]),
    ({"meta": _at(1, None, -2)}, ["world_size (in 'meta') must lie in [1, 65536], got -2"]),
    ({"meta": lambda a: a[:2]}, ["'meta' must hold [num_experts, world_size, token_bytes]"]),
    ({"meta": None}, ["lacks the array 'meta'"]),
    ({"src_rank": _at(0, None, 5)}, ["src_rank holds ids outside [0, 1)"]),
    ({"expert_idx": lambda a: a.astype(float)}, ["'expert_idx' must be a 2-D integer array"]),
    ({"probs": lambda a: a[:, :3]}, ["'probs' must be finite [30, 8]"]),
])
def test_a_damaged_routing_record_names_the_file(capsys, tmp_path, change, fragments):
    run = _record(tmp_path, **change)
    where = f"routing record {run / 'routing.npz'}"
    _fails(capsys, "place", "--topology", "node=2,gpu=2", "--stats", str(run), "--out", str(tmp_path / "p.yaml"),
           fragments=[where, *fragments])
    _fails(capsys, "report", str(run), fragments=[where, *fragments])


def test_a_damaged_dispatch_sidecar_names_the_file(capsys, tmp_path):
    run = _record(tmp_path)
    for text, says in (("[" * 100000, "is not valid JSON"), ('{"topology": 3}', "a 'topology' string"),
                       ('{"topology": "node=0,gpu=2"}', "positive ints")):
        (run / "routing.json").write_text(text)
        _fails(capsys, "report", str(run), fragments=[str(run / "routing.json"), says])


@pytest.mark.parametrize("data,fragments", [
    ({"world_size": 4, "expert_to_rank": 3}, ["'expert_to_rank' must be a list of int ranks", "got 3"]),
    ({"world_size": 2, "expert_to_rank": [0, 0.7, 1.2, 1]}, ["'expert_to_rank' must be a list of int", "0.7"]),
    ({"world_size": 2.0, "expert_to_rank": [0, 0, 1, 1]}, ["'world_size' must be an int, got 2.0"]),
])
def test_a_bad_placement_file_names_it(tmp_path, data, fragments):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError) as e:
        Placement.from_yaml(path)
    assert str(path) in str(e.value) and all(f in str(e.value) for f in fragments), str(e.value)


@pytest.mark.parametrize("text,fragments", [
    ("levels: node\nsizes: 4\n", ["'levels' must be a list, got 'node'"]),
    ("levels: [node, gpu]\nsizes: [2, 2]\ncost: {node: {alpha_s: .inf}}\n", ["'cost.node.alpha_s' must be a finite"]),
    ("levels: [node, gpu]\nsizes: [2, 2]\ncost: 5\n", ["'cost' must be a mapping, got 5"]),
    ("levels: [node, gpu]\nsizes: [2, 2]\nexchange: {latency_s: abc}\n", ["'exchange.latency_s' must be a finite"]),
])
def test_a_bad_topology_file_names_the_key(tmp_path, text, fragments):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        Topology.from_yaml(path)
    assert str(path) in str(e.value) and all(f in str(e.value) for f in fragments), str(e.value)


@pytest.mark.parametrize("spec,fragments", [
    ("garbage", ["DIST_MOE_TOPOLOGY='garbage'", "each part must look like level=size"]),
    ("node=0,gpu=1", ["DIST_MOE_TOPOLOGY='node=0,gpu=1'", "positive ints"]),
])
def test_a_bad_topology_variable_is_refused_in_one_process_too(monkeypatch, spec, fragments):
    monkeypatch.setenv("DIST_MOE_TOPOLOGY", spec)
    with pytest.raises(ValueError) as e:
        Topology.launched(1)
    assert all(f in str(e.value) for f in fragments), str(e.value)
    monkeypatch.delenv("DIST_MOE_TOPOLOGY")
    assert Topology.launched(1) == Topology.flat(1)


def test_place_refuses_an_endless_exact_search(capsys, tmp_path):
    _fails(capsys, "place", "--topology", "node=2,gpu=2", "--stats", str(_record(tmp_path)), "--out",
           str(tmp_path / "p.yaml"), "--exact-seconds", "inf", fragments=["--exact-seconds must be a finite number"])


def test_the_run_config_a_report_reads_is_checked(capsys, tmp_path):
    run = _record(tmp_path)
    (run / "config.yaml").write_text("parallel: [1]\n")
    _fails(capsys, "report", str(run), fragments=[f"run config {run / 'config.yaml'}", "parallel.placement"])
    (run / "config.yaml").write_text("a: 1\nb: 2\na: 3\n")
    _fails(capsys, "report", str(run), fragments=["duplicate key 'a'"])


def test_a_run_summary_is_strict_json_at_any_depth(tmp_path):
    """An experiment's measures join the summary nested; a NaN there is null, never a bare NaN token."""
    import json
    import math

    from dist_moe.train.metrics.log import json_safe
    from dist_moe.train.trainer import train

    assert json_safe({"a": {"b": [math.nan, 1.0]}, "c": math.inf, "d": "x"}) == {"a": {"b": [None, 1.0]}, "c": None,
                                                                                  "d": "x"}
    cfg = load_config(None, [*TINY[1:], "train.max_steps=2", f"output.dir={tmp_path}"])
    summary = train(cfg, quiet=True, after=lambda *_: {"measures": {"purity": math.nan, "per_task": [math.inf]}})
    assert summary["measures"] == {"purity": None, "per_task": [None]}
    json.loads((tmp_path / "summary.json").read_text(), parse_constant=lambda name: 1 / 0)  # no NaN token
