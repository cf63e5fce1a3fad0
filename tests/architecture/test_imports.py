"""The import graph inside dist_moe and placement: no module reaches itself again through its
imports, lazy ones inside functions included (the data modules once did: data -> wordnet_glosses
-> corpus -> data)."""
import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


PACKAGES = ("dist_moe", "placement", "experiments")


def modules() -> dict:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, is_package: bool, node) -> list:
    """The module names an import statement of module ``name`` may reach (relative ones resolved)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # from .x import y / from .. import z: relative to this module's package
        package = name.split(".") if is_package else name.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def import_graph(planted: dict | None = None) -> dict:
    """Module -> the modules it imports, lazy imports inside functions included; ``planted`` maps a
    module to a source text to read instead of its file (the tests' planted violations)."""
    found, graph = modules(), {}
    for name, path in found.items():
        text = (planted or {}).get(name) or path.read_text()
        deps = set()
        for node in ast.walk(ast.parse(text)):
            deps |= {t for t in imported(name, path.name == "__init__.py", node) if t in found and t != name}
        graph[name] = deps
    return graph


def cycles_through(graph: dict, start: str) -> list:
    """Import paths from ``start`` back to itself (one per first step)."""
    found = []
    for first in sorted(graph[start]):
        seen, stack = {first}, [(first, [start, first])]
        while stack:
            node, path = stack.pop()
            if start in graph[node]:
                found.append(path + [start])
                break
            for nxt in sorted(graph[node] - seen):
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return found


def circles(graph: dict) -> list:
    return [" -> ".join(c) for m in sorted(graph) for c in cycles_through(graph, m)]


def test_no_import_circle():
    graph = import_graph()
    assert {"dist_moe.data.corpus", "dist_moe.moe.layer", "placement.plan", "experiments.tables"} <= set(graph)
    assert "dist_moe.dispatch.pipeline" in graph["dist_moe.dispatch.dispatcher"]  # edges are read
    assert not circles(graph), circles(graph)


def test_the_walk_sees_relative_and_lazy_imports():
    base = (ROOT / "dist_moe" / "routing" / "base.py").read_text()
    # a real circle through a relative import: routing.base -> routing.registry -> ... -> routing.base
    planted = import_graph({"dist_moe.routing.base": base + "\nfrom .registry import ROUTERS\n"})
    assert "dist_moe.routing.registry" in planted["dist_moe.routing.base"]
    assert any(c.startswith("dist_moe.routing.base ->") for c in circles(planted))
    # the experiments' tables once imported their table modules lazily, which imported them back
    tables = (ROOT / "experiments" / "table_gar.py").read_text()
    planted = import_graph({"experiments.table_gar": tables + "\ndef f():\n    from experiments.tables import write\n"})
    assert any("experiments.tables" in c for c in circles(planted))


def test_routing_is_pure_tensor_math():
    """Routing strategies run no backward, no optimizer and no collective (GAR's step and the gradient
    collectives live in dist_moe/train, the routers' reductions in dist_moe/distributed)."""
    def calls(path, text=None):
        found = []
        for node in ast.walk(ast.parse(text or path.read_text())):
            name = None
            if isinstance(node, ast.Attribute) and node.attr in ("backward", "zero_grad", "distributed", "grad"):
                name = node.attr  # x.backward(), opt.zero_grad(), torch.distributed.*, torch.autograd.grad
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step":
                name = "optimizer step" if "opt" in ast.unparse(node.func.value) else None
            elif isinstance(node, (ast.Import, ast.ImportFrom)):  # from torch import distributed too
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                name = next((m for m in mods if m.startswith(("torch.distributed", "torch.optim"))), None)
            if name:
                found.append(f"{path.name}:{node.lineno} {name}")
        return found

    assert not [c for path in sorted((ROOT / "dist_moe" / "routing").glob("*.py")) for c in calls(path)]
    # the check reads what it should: GAR's step and the gradient collectives fail it
    gar_step = ROOT / "dist_moe" / "train" / "step" / "gar_step.py"
    assert {c.split(" ", 1)[1] for c in calls(gar_step)} >= {"backward", "optimizer step"}
    assert calls(ROOT / "dist_moe" / "distributed" / "reductions.py")
    flat = ROOT / "dist_moe" / "routing" / "flat.py"
    for planted in ("from torch import distributed", "from torch import optim", "import torch.distributed as d"):
        assert calls(flat, flat.read_text() + f"\n{planted}\n"), planted


# dispatch/ is the exchange and nothing else
EXCHANGE = {"__init__", "contract", "exchange", "dispatcher", "pipeline", "all_to_all", "apply_experts", "combine",
            "agree", "profiling", "wire", "weight_casts"}
# what the exchange and the process-group package may import of dist_moe: themselves and what lies below them
BELOW = {"dist_moe.dispatch": ("dist_moe.dispatch", "dist_moe.distributed.groups", "dist_moe.distributed.reductions",
                               "dist_moe.distributed.collective_order", "dist_moe.config", "dist_moe.errors"),
         "dist_moe.distributed": ("dist_moe.distributed", "dist_moe.config", "dist_moe.errors")}
# where torch.distributed is imported: the exchange, process groups and devices, the trainer's gradient sums,
# expert groups and checkpoints, the engines' own groups, and the one placement module that needs a cluster
TALKS_TO_TORCH_DISTRIBUTED = ("dist_moe/dispatch/", "dist_moe/distributed/", "dist_moe/train/",
                              "dist_moe/integrations/", "placement/calibrate.py")


def distributed_importers(planted: dict | None = None) -> list[str]:
    """Modules of dist_moe and placement outside ``TALKS_TO_TORCH_DISTRIBUTED`` that import torch.distributed."""
    found = []
    for root in ("dist_moe", "placement"):
        for path in sorted((ROOT / root).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel.startswith(TALKS_TO_TORCH_DISTRIBUTED):
                continue
            for node in ast.walk(ast.parse((planted or {}).get(rel) or path.read_text())):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    mods = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                else:
                    continue
                if any(m.startswith("torch.distributed") for m in mods):
                    found.append(f"{rel}:{node.lineno}")
    return found


def reaching_up(graph: dict) -> list[str]:
    """Imports of dispatch/ and distributed/ that reach a dist_moe module outside what lies below them."""
    return [f"{m} -> {d}" for m in sorted(graph) for pkg, allowed in BELOW.items() if m.startswith(pkg)
            for d in sorted(graph[m]) if d.startswith("dist_moe.") and not d.startswith(allowed)]


def test_dispatch_is_the_exchange_and_only_named_packages_talk_to_torch_distributed():
    assert {p.stem for p in (ROOT / "dist_moe" / "dispatch").glob("*.py")} == EXCHANGE
    assert not distributed_importers(), distributed_importers()
    graph = import_graph()
    assert "dist_moe.distributed.reductions" in graph["dist_moe.dispatch.agree"]  # edges are read
    assert not reaching_up(graph), reaching_up(graph)
    # planted: a model module importing torch.distributed, the exchange reaching the trainer, the process
    # groups reaching the exchange
    experts = "dist_moe/moe/experts.py"
    assert distributed_importers({experts: (ROOT / experts).read_text() + "\nfrom torch import distributed\n"}) \
        == [f"{experts}:{len((ROOT / experts).read_text().splitlines()) + 2}"]
    for module, line in (("dist_moe.dispatch.exchange", "from dist_moe.train.step.grads import clip_to"),
                         ("dist_moe.distributed.process_group", "from dist_moe.dispatch.dispatcher import kept_pairs")):
        path = ROOT / (module.replace(".", "/") + ".py")
        planted = import_graph({module: path.read_text() + f"\n{line}\n"})
        assert reaching_up(planted) == [f"{module} -> {line.split()[1]}"], reaching_up(planted)


# what the config schema and the config package may import: the config vocabulary, the router and GAR
# configs (the strategies' own), the error helper, placement's names
CONFIG_READS = ("dist_moe.config", "dist_moe.errors", "dist_moe.routing.gar", "dist_moe.routing.registry",
                "placement.names")


def config_imports(graph: dict) -> list:
    """Imports of the schema's and the config package's modules that reach an implementation module."""
    return [f"{m} -> {d}" for m in sorted(graph) if m.startswith(("dist_moe.config", "dist_moe.train.run_config"))
            for d in sorted(graph[m]) if not d.startswith(CONFIG_READS)]


def test_the_config_schema_is_a_leaf_that_imports_no_implementation():
    graph = import_graph()
    assert {"dist_moe.train.run_config", "dist_moe.config.choices", "dist_moe.config.types"} <= set(graph)
    assert not config_imports(graph), config_imports(graph)
    # the names it checks are the implementations' own: one source, read from config/choices.py
    from dist_moe.config import choices
    from dist_moe.integrations.megatron.patches import DISPATCHERS
    from dist_moe.moe.experts import KINDS
    from dist_moe.train.build import MODEL_KINDS
    from dist_moe.train.step.engines import ENGINES
    assert tuple(ENGINES) == choices.ENGINES and MODEL_KINDS == choices.MODEL_KINDS
    assert KINDS is choices.EXPERT_KINDS and DISPATCHERS is choices.MEGATRON_DISPATCHERS
    # planted: the schema reading the engines again is caught
    schema = (ROOT / "dist_moe" / "train" / "run_config.py").read_text()
    planted = import_graph({"dist_moe.train.run_config":
                            schema + "\nfrom dist_moe.train.step.engines import ENGINES\n"})
    assert config_imports(planted) == ["dist_moe.train.run_config -> dist_moe.train.step.engines"]


# the layout by stage, and the public names where users import them
LAYOUT = ["dist_moe/moe/layer.py", "dist_moe/moe/forward.py", "dist_moe/moe/experts.py", "dist_moe/moe/view.py",
          "dist_moe/dispatch/contract.py", "dist_moe/dispatch/exchange.py", "dist_moe/dispatch/pipeline.py",
          "dist_moe/dispatch/agree.py", "dist_moe/train/run_config.py", "dist_moe/config/choices.py",
          "dist_moe/routing/gar.py", "dist_moe/train/step/gar_step.py", "dist_moe/integrations/deepspeed/patches.py",
          "dist_moe/integrations/megatron/patches.py", "dist_moe/integrations/transformers/ep.py",
          *(f"dist_moe/cli/{c}.py" for c in ("train", "report", "place", "simulate", "plan", "calibrate"))]


def test_the_layout_is_by_stage_and_the_public_names_import_where_users_import_them():
    missing = [p for p in LAYOUT if not (ROOT / p).is_file()]
    assert not missing, missing
    gone = [p for p in ("layer.py", "experts.py", "moe_view.py", "config_types.py", "cli.py", "cli_cost.py")
            if (ROOT / "dist_moe" / p).exists()]
    assert not gone, gone
    import dist_moe
    import dist_moe.routing
    import dist_moe.routing.gar
    import placement
    from dist_moe.cli import main
    from dist_moe.moe.layer import MoELayer, MoELayerConfig
    assert dist_moe.MoELayer is MoELayer and dist_moe.MoELayerConfig is MoELayerConfig and callable(main)
    assert {"Router", "Routing", "build_router"} <= set(dir(dist_moe.routing))
    assert {"gar_loss", "gar_loss_gram", "GARConfig"} <= set(dir(dist_moe.routing.gar))
    assert {"Topology", "Placement", "dispatch_traffic", "tree_distance", "DispatchPlan"} <= set(dir(placement))
    engines = {"dist_moe.integrations.megatron": ("dist_moe_mlp_spec", "DistMoERouter", "megatron_config"),
               "dist_moe.integrations.deepspeed": ("deepspeed_moe_layer", "DistMoEGate", "use_dist_moe_dispatcher"),
               "dist_moe.integrations.transformers": ("use", "traffic", "reset_traffic")}
    for module, names in engines.items():
        assert set(names) <= set(dir(importlib.import_module(module))), module


# routers take their hyperparameters as a torch module does; deepspeed_moe_layer mirrors deepspeed.moe.layer.MoE
WIDE_ALLOWED = {"dist_moe/integrations/deepspeed/layer.py:deepspeed_moe_layer"}
MAX_PARAMETERS = 8


def wide_signatures(planted: dict | None = None) -> list:
    """Public functions and methods of dist_moe and placement with more than MAX_PARAMETERS parameters
    (self and cls not counted; *args and **kwargs counted), but the routers' constructors."""
    out = []
    for root in ("dist_moe", "placement"):
        for path in sorted((ROOT / root).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            tree = ast.parse((planted or {}).get(rel) or path.read_text())
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if node.name.startswith("_") and node.name != "__init__":
                    continue
                a = node.args
                n = len(a.posonlyargs + a.args + a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
                n -= bool(a.args and a.args[0].arg in ("self", "cls"))
                router = rel.startswith("dist_moe/routing/") and node.name == "__init__"
                if n > MAX_PARAMETERS and not router and f"{rel}:{node.name}" not in WIDE_ALLOWED:
                    out.append(f"{rel}:{node.lineno} {node.name} ({n})")
    return out


def test_no_public_signature_takes_more_than_eight_parameters():
    assert not wide_signatures(), wide_signatures()
    planted = "\n\ndef too_wide(a, b, c, d, e, f, g, h, i):\n    pass\n"
    path = "placement/forecast.py"
    found = wide_signatures({path: (ROOT / path).read_text() + planted})
    assert found == [f"{path}:{_last_line(path) + 3} too_wide (9)"]


def _last_line(path: str) -> int:
    return len((ROOT / path).read_text().splitlines())
