"""The import graph inside dist_moe and placement: no module reaches itself again through its
imports, lazy ones inside functions included (the data modules once did: data -> wordnet_glosses
-> corpus -> data)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_graph() -> dict:
    modules = {}
    for pkg in ("dist_moe", "placement"):
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps |= {t for t in targets if t in modules and t != name}
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


def test_no_import_circle():
    graph = import_graph()
    assert {"dist_moe.data.corpus", "dist_moe.layer", "placement.plan"} <= set(graph)
    assert "dist_moe.dispatch.pipeline" in graph["dist_moe.dispatch.dispatcher"]  # edges are read
    circles = [" -> ".join(c) for m in sorted(graph) for c in cycles_through(graph, m)]
    assert not circles, circles


def test_routing_is_pure_tensor_math():
    """Routing strategies run no backward, no optimizer and no collective (GAR's step lives in
    dist_moe/gar, gradient collectives in dist_moe/dispatch)."""
    def calls(path):
        found = []
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute) and node.attr in ("backward", "zero_grad", "distributed", "grad"):
                name = node.attr  # x.backward(), opt.zero_grad(), torch.distributed.*, torch.autograd.grad
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step":
                name = "optimizer step" if "opt" in ast.unparse(node.func.value) else None
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                name = next((m for m in mods if m.startswith(("torch.distributed", "torch.optim"))), None)
            if name:
                found.append(f"{path.name}:{node.lineno} {name}")
        return found

    assert not [c for path in sorted((ROOT / "dist_moe" / "routing").glob("*.py")) for c in calls(path)]
    # the check reads what it should: GAR's step and the gradient collectives fail it
    assert {c.split(" ", 1)[1] for c in calls(ROOT / "dist_moe" / "gar" / "step.py")} >= {"backward", "optimizer step"}
    assert calls(ROOT / "dist_moe" / "dispatch" / "stats.py")
