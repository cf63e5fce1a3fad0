"""An optional engine is imported where it is used; a missing one is one line naming its extra."""
import logging

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


def test_the_cpu_fallback_line_of_an_engine_is_dropped_and_nothing_else():
    """DeepSpeed's note that it found no GPU, which transformers' model loading imports it to say: dropped on its
    logger, which DeepSpeed takes over when imported (with its filters); its other lines pass."""
    logger = logging.getLogger("DeepSpeed")

    def passes(message: str) -> bool:
        return bool(logger.filter(logging.LogRecord("DeepSpeed", logging.WARNING, "real_accelerator.py", 213,
                                                    message, None, None)))

    assert not passes("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
    assert passes("Setting ds_accelerator to cuda (auto detect)")
