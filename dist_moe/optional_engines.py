"""The optional engines (deepspeed, megatron-core, transformers) are imported where they are used,
through ``engine_import``, never at the top of a module: dist-moe imports and runs without any of them,
and megatron-core's modules load only after ``integrations.megatron_patches.apply()`` has patched them
for the CPU. A missing engine is a one-line error naming the extra that installs it."""
from __future__ import annotations

import importlib
import logging

# an engine's top-level package -> (its distribution, the dist-moe extra that installs it)
ENGINES = {"deepspeed": ("deepspeed", "deepspeed"), "megatron": ("megatron-core", "megatron"),
           "transformers": ("transformers", "text"), "safetensors": ("safetensors", "text")}
# DeepSpeed's line on every machine where it finds no GPU, logged when it is first imported, which transformers and
# accelerate do while saving or loading a model: dist-moe runs on the CPU there by choice, so it says nothing to act on
DEEPSPEED_CPU_NOTE = "Setting accelerator to CPU."


def _not_deepspeed_cpu_note(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(DEEPSPEED_CPU_NOTE)


# On DeepSpeed's logger, made here before DeepSpeed makes it (getLogger returns the same one, filters kept): only
# that one line is dropped, whoever imports DeepSpeed after dist-moe, and nothing else DeepSpeed logs
logging.getLogger("DeepSpeed").addFilter(_not_deepspeed_cpu_note)


def engine_import(module: str, *names: str):
    """``module`` (no ``names``), or its attribute or submodule ``names[0]``, or a tuple of several."""
    loaded = _load(module)
    if not names:
        return loaded
    found = tuple(getattr(loaded, n) if hasattr(loaded, n) else _load(f"{module}.{n}") for n in names)
    return found[0] if len(found) == 1 else found


def _load(module: str):
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if top not in ENGINES or e.name != top:
            raise  # something else is missing (a module of an installed engine, or another package)
        package, extra = ENGINES[top]
        raise ValueError(f"{package} is not installed: pip install -e '.[{extra}]'") from None
