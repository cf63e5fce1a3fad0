"""pyproject's ``torch>=`` is dist_moe.torch_floor's floor, set by the newest torch API the code calls, and
on the installed torch every torch name the package reaches exists and takes the keywords it is given (run
under a torch at the floor, this proves the floor is enough)."""
import ast
import importlib
import inspect
import re
from pathlib import Path

import torch

from dist_moe.torch_floor import NEWEST_API, TORCH_FLOOR

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dist_moe", "placement")  # what pip installs (pyproject's packages.find)


def pinned_floor() -> tuple[int, int]:
    """The (major, minor) of pyproject's ``torch>=X.Y``, its only torch requirement (no upper bound, no pin)."""
    deps = re.search(r"^dependencies = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    torch_deps = [d for d in re.findall(r'"([^"]+)"', deps) if re.match(r"torch\b", d)]
    assert len(torch_deps) == 1 and re.fullmatch(r"torch>=\d+\.\d+", torch_deps[0]), torch_deps
    major, minor = torch_deps[0].removeprefix("torch>=").split(".")
    return int(major), int(minor)


def _aliases(tree) -> dict[str, str]:
    """Local name -> the torch dotted name it stands for, from every import in the module (lazy ones too)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    names[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return names


def _dotted(node, aliases) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def resolve(dotted: str):
    """The object a dotted torch name names, importing modules as needed (AttributeError or ImportError if none)."""
    parts = dotted.split(".")
    obj, i = importlib.import_module(parts[0]), 1
    while i < len(parts):
        try:
            obj = getattr(obj, parts[i])
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i + 1]))  # a submodule not yet imported
        i += 1
    return obj


def torch_uses(sources: dict[str, str]) -> tuple[set[str], set[tuple[str, str]]]:
    """Every torch dotted name the sources reach, and every (callable, keyword) they pass."""
    names, keywords = set(), set()
    for text in sources.values():
        tree = ast.parse(text)
        aliases = _aliases(tree)
        names |= set(aliases.values())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):  # a.b.c, and its prefixes a.b on their own visit
                dotted = _dotted(node, aliases)
                if dotted:
                    names.add(dotted)
            if isinstance(node, ast.Call):
                func = _dotted(node.func, aliases) if isinstance(node.func, ast.Attribute) else \
                    aliases.get(getattr(node.func, "id", None))
                keywords |= {(func, k.arg) for k in node.keywords if func and k.arg}
    return names, keywords


def problems(sources: dict[str, str]) -> list[str]:
    """What the installed torch lacks of what the sources use."""
    names, keywords = torch_uses(sources)
    found = []
    for name in sorted(names):
        try:
            resolve(name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] == "torch":
                found.append(f"{name}: not in torch {torch.__version__}")
            # else a torch module that imports an optional package (torch.utils.tensorboard: tensorboard)
        except (AttributeError, ImportError):
            found.append(f"{name}: not in torch {torch.__version__}")
    for func, keyword in sorted(keywords):
        try:
            params = inspect.signature(resolve(func)).parameters
        except (ValueError, TypeError, AttributeError, ImportError):
            continue  # a C builtin without a signature, or a missing name (reported above)
        if keyword not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            found.append(f"{func}({keyword}=...): not taken by torch {torch.__version__}")
    return found


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def test_pyproject_requires_the_floor_its_newest_api_sets():
    assert pinned_floor() == TORCH_FLOOR == NEWEST_API[2]
    name, where, _ = NEWEST_API
    assert name.rsplit(".", 1)[1] + "(" in (ROOT / where.split(":")[0]).read_text()  # the code calls it
    resolve(name)
    assert tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= TORCH_FLOOR


def test_every_torch_name_the_package_reaches_exists_in_this_torch():
    sources = package_sources()
    names, keywords = torch_uses(sources)
    # the walk sees aliases, from-imports, lazy imports and keywords (it is not vacuous)
    assert {"torch.nn.functional.grouped_mm", "torch.distributed.all_to_all_single",
            "torch.distributed.checkpoint.filesystem._StorageInfo", "torch.cuda.set_device"} <= names
    assert {("torch.distributed.checkpoint.save", "no_dist"), ("torch.nn.functional.grouped_mm", "offs")} <= keywords
    assert problems(sources) == []


def test_a_name_or_keyword_this_torch_lacks_is_reported():
    planted = {"x.py": "import torch.nn.functional as F\nfrom torch.distributed import checkpoint as dcp\n"
                       "def f(a, w):\n    dcp.save({}, no_dist=True, bogus=1)\n    return F.grouped_mm_v0(a, w)\n"}
    version = torch.__version__
    assert problems(planted) == [f"torch.nn.functional.grouped_mm_v0: not in torch {version}",
                                 f"torch.distributed.checkpoint.save(bogus=...): not taken by torch {version}"]
