"""An optional engine is imported where it is used; a missing one is one line naming its extra."""
import pytest

from dist_moe.optional_engines import ENGINES, engine_import


def test_a_missing_engine_names_the_extra_that_installs_it(monkeypatch):
    monkeypatch.setitem(ENGINES, "absent_engine", ("absent-engine", "absent"))  # an engine not installed here
    with pytest.raises(ValueError, match=r"^absent-engine is not installed: pip install -e '\.\[absent\]'$"):
        engine_import("absent_engine.moe.layer", "MoE")


def test_names_and_submodules_come_back_as_asked():
    pytest.importorskip("transformers", reason="transformers is not installed")
    mixtral = engine_import("transformers.models", "mixtral")  # a submodule, loaded on demand
    assert mixtral.__name__ == "transformers.models.mixtral"
    auto, tok = engine_import("transformers", "AutoConfig", "AutoTokenizer")
    assert auto.__name__ == "AutoConfig" and tok.__name__ == "AutoTokenizer"
    with pytest.raises(ModuleNotFoundError):  # a module an installed engine lacks is not "not installed"
        engine_import("transformers.no_such_module")
