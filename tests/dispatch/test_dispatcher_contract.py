"""One dispatcher contract and one routing prologue for dist-moe's MoELayer and both engines'
layers (the local == expert-parallel equality on one rank is tests/benchmarks/test_gpu_check.py's ep_fp32;
across ranks, tests/moe/test_layer.py, test_megatron_dispatcher.py and test_deepspeed_dispatcher.py)."""
import ast
import importlib
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_moe.dispatch.contract import Dispatcher
from dist_moe.dispatch.dispatcher import ExpertParallelDispatcher, LocalDispatcher, make_dispatcher
from dist_moe.moe.layer import MoELayer
from placement import Placement, Topology

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["dist_moe/moe/layer.py", "dist_moe/integrations/megatron/layer.py",
          "dist_moe/integrations/deepspeed/dispatch.py"]


def _calls(path: str) -> set:
    names = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


HOSTS = LAYERS + ["dist_moe/integrations/transformers/ep.py", "dist_moe/integrations/transformers/hosted.py"]


def _call_order(path: str, function: str) -> list:
    """The names called in ``function`` of ``path``, in the order they are written."""
    tree = ast.parse((ROOT / path).read_text())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    calls = [n for n in ast.walk(body) if isinstance(n, ast.Call)]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    return [n.func.id if isinstance(n.func, ast.Name) else n.func.attr if isinstance(n.func, ast.Attribute) else ""
            for n in calls]


def test_every_host_runs_the_one_forward_and_none_writes_its_stages_again():
    order = [c for c in _call_order("dist_moe/moe/forward.py", "moe_forward")
             if c in {"agreement", "route", "dispatch", "experts_and_combine"}]
    # the stages, once, in order: the route inside the ranks' agreement, then dispatch, experts and combine
    assert order == ["agreement", "route", "dispatch", "experts_and_combine"]
    for path in HOSTS:
        calls = _calls(path)
        assert "moe_forward" in calls and "keep" in calls | _calls("dist_moe/integrations/megatron/router.py"), path
        # the agreement, the exchange and the input check belong to forward.py, exchange.py and agree.py
        assert not calls & {"agreement", "agreed_routing", "agree", "profiled", "ExpertParallelDispatcher",
                            "make_dispatcher", "dispatch", "experts_and_combine", "run_pipeline"}, path
    # the engines' gates and routers run the same route stage, agreeing with one all-reduce
    for path in ("dist_moe/integrations/megatron/router.py", "dist_moe/integrations/deepspeed/layer.py"):
        calls = _calls(path)
        assert "agreed_route" in calls and not calls & {"agreed_routing", "agree", "profiled"}, path
    # the engines' routers build their tokens with tokens_in, as MoELayer does, through one helper
    assert "tokens_in" in _calls("dist_moe/moe/layer.py") and "tokens_in" in _calls("dist_moe/integrations/context.py")
    for path in ("dist_moe/integrations/megatron/router.py", "dist_moe/integrations/deepspeed/layer.py"):
        assert "context_tokens" in _calls(path) and not _calls(path) & {"tokens_in", "input_problem"}, path


def test_a_host_forward_reads_tokens_then_the_forward_then_what_it_keeps():
    order = [c for c in _call_order("dist_moe/moe/layer.py", "forward") if c in {"tokens", "moe_forward", "keep"}]
    assert order == ["tokens", "moe_forward", "keep"]
    order = [c for c in _call_order("dist_moe/integrations/transformers/hosted.py", "forward")
             if c in {"chosen_tokens", "moe_forward", "keep"}]
    assert order == ["chosen_tokens", "moe_forward", "keep"]


def test_no_host_class_inherits_a_mixin():
    """Each host is one class over nn.Module or its engine's own layer: the stages are composed, not inherited."""
    from torch import nn

    from dist_moe.integrations.transformers.hosted import HostedHFExperts

    assert MoELayer.__bases__ == (nn.Module,) and HostedHFExperts.__bases__ == (nn.Module,)
    engines = {"deepspeed.dispatch": ("deepspeed", "layer_class"), "megatron.layer": ("megatron.core", "layer_class"),
               "transformers.ep": ("transformers.distributed.expert_parallel", "implementation_class")}
    for module, (engine, factory) in engines.items():
        if _importable(engine):
            mod = importlib.import_module(f"dist_moe.integrations.{module}")
            cls = getattr(mod, factory)()
            assert len(cls.__bases__) == 1 and cls.__bases__[0].__module__.startswith(engine.split(".")[0]), module
    for module, name in (("dist_moe.integrations.deepspeed", "DeepSpeedHostedMoE"),
                         ("dist_moe.integrations.megatron", "MegatronHostedMoE")):
        engine = module.rsplit(".", 1)[1].replace("megatron", "megatron.core")
        if _importable(engine):
            assert getattr(importlib.import_module(module), name).__bases__ == (nn.Module,), name


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_both_dispatchers_have_the_contracts_members():
    members = {n for n in vars(Dispatcher) if not n.startswith("_")} | set(Dispatcher.__annotations__) | {"__call__"}
    assert {"exchanges", "traffic", "reset_traffic", "metadata_bytes", "rank"} <= members
    for cls in (LocalDispatcher, ExpertParallelDispatcher):
        missing = [m for m in members if not hasattr(cls, m) and m not in ("rank", "metadata_bytes")]
        assert not missing, (cls.__name__, missing)
    assert LocalDispatcher.exchanges is False and ExpertParallelDispatcher.exchanges is True


def test_the_local_dispatcher_counts_nothing_and_maps_ids_to_slots():
    from dist_moe.dispatch.contract import CountsBytes
    from dist_moe.integrations.deepspeed import DistMoEGate

    layer = MoELayer(8, 16, {"type": "switch", "num_experts": 4, "top_k": 2})
    assert isinstance(layer.dispatcher, LocalDispatcher) and not layer.dispatcher.exchanges
    # what the byte log asks of a layer; DeepSpeed's gate counts its own engine's bytes, another way
    assert isinstance(layer, CountsBytes)
    assert not isinstance(DistMoEGate({"type": "switch", "num_experts": 4, "top_k": 2}, 8), CountsBytes)
    layer(torch.randn(5, 8))
    assert layer.traffic.matrix.tolist() == [[0]] and layer.metadata_bytes == 0


def test_engine_slots_are_where_contiguous_engines_hold_each_expert():
    p = Placement.round_robin(8, 2)  # expert e on rank e % 2, local slot e // 2
    assert p.engine_slots().tolist() == [(e % 2) * 4 + e // 2 for e in range(8)]
    for r in range(2):  # the engine holds local_experts(r) in order at slots r * E/W ...
        assert [int(p.engine_slots()[e]) for e in p.local_experts(r)] == list(range(r * 4, r * 4 + 4))
    with pytest.raises(ValueError, match=r"every rank must hold 4 experts, got counts \[5, 3\]"):
        Placement([0, 0, 0, 0, 0, 1, 1, 1], 2)  # why the engines need no check of their own


def test_the_design_names_import_where_it_puts_them():
    pytest.importorskip("megatron.core")
    from dist_moe.integrations.deepspeed import deepspeed_moe_layer  # noqa: F401
    from dist_moe.integrations.megatron import DistMoERouter, dist_moe_mlp_spec, megatron_dist_moe_layer
    from dist_moe.integrations.megatron import layer as megatron_layer
    from dist_moe.integrations.megatron import router as megatron_router

    assert dist_moe_mlp_spec is megatron_layer.dist_moe_mlp_spec
    assert megatron_dist_moe_layer is megatron_layer.megatron_dist_moe_layer
    assert DistMoERouter is megatron_router.DistMoERouter


def test_node_dedup_is_refused_for_an_expert_parallel_group_of_part_of_the_world(monkeypatch):
    """Node dedup's per-node groups are made collectively over the world's ranks: an EP group of 4 of 8
    ranks would wait in new_group for ranks that never come. make_dispatcher, where every host (MoELayer,
    Megatron's and DeepSpeed's dispatched layers) gets its dispatcher, refuses it; rank dedup is left alone,
    and so is node dedup where the group's topology has one rank per node (it runs as rank dedup)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8 if group is None else 4)
    made = []
    monkeypatch.setattr(ExpertParallelDispatcher, "__init__", lambda self, *args: made.append(args[3]))
    placement, topo = Placement.contiguous(8, 4), Topology(("node", "gpu"), (2, 2))
    with pytest.raises(ValueError, match=r"^dedup='node' needs the expert-parallel group to be the whole world "
                                         r"\(4 of 8 ranks\); use dedup='rank'$"):
        make_dispatcher(object(), placement, topo, "node")
    make_dispatcher(object(), placement, topo, "rank")
    make_dispatcher(object(), placement, Topology(("node", "gpu"), (4, 1)), "node")
    assert made == ["rank", "node"]
