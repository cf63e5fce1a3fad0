"""The optional engines (deepspeed, megatron-core, transformers) are imported where they are used,
through ``engine_import``, never at the top of a module: dist-moe imports and runs without any of them,
and megatron-core's modules load only after ``integrations.megatron_patches.apply()`` has patched them
for the CPU. A missing engine is a one-line error naming the extra that installs it."""
from __future__ import annotations

import importlib

# an engine's top-level package -> (its distribution, the dist-moe extra that installs it)
ENGINES = {"deepspeed": ("deepspeed", "deepspeed"), "megatron": ("megatron-core", "megatron"),
           "transformers": ("transformers", "text"), "safetensors": ("safetensors", "text")}


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
