"""One config path: a training run's layer and exchange settings are built from its run config in one
module (dist_moe/train/layer_config.py), with one set of defaults."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILT_BY = {"MoELayerConfig", "ExchangeConfig"}
ONE_PLACE = "dist_moe/train/layer_config.py"


def builders(sources: dict[str, str]) -> list[str]:
    """'path:line Name' for every call that builds a layer or exchange config."""
    out = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in BUILT_BY:
                out.append(f"{path}:{node.lineno} {node.func.id}")
    return sorted(out)


def _trainer_sources() -> dict[str, str]:
    trees = [ROOT / "dist_moe" / "train", ROOT / "dist_moe" / "cli"]
    return {str(p.relative_to(ROOT)): p.read_text() for t in trees for p in t.rglob("*.py")}


def test_the_run_config_builds_layer_and_exchange_configs_in_one_place():
    found = builders(_trainer_sources())
    assert found and all(b.startswith(ONE_PLACE + ":") for b in found), found
    assert {b.split()[1] for b in found} == BUILT_BY


def test_a_second_mapping_is_seen():
    sources = _trainer_sources()
    runtime = "dist_moe/train/runtime.py"
    sources[runtime] += "\n\ndef again(p):\n    return ExchangeConfig(p.dedup)\n"
    assert [b for b in builders(sources) if not b.startswith(ONE_PLACE)] == [
        f"{runtime}:{len(sources[runtime].splitlines())} ExchangeConfig"]
