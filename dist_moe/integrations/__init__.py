"""Engine adapters: one package per engine (``deepspeed/``, ``megatron/``, ``transformers/``), each with
its public names in its ``__init__`` and its monkeypatches, dated by release, in its ``patches.py``;
what they share beside: ``context.py`` (per-token routing inputs), ``hosted.py`` (dist-moe's layer
interface over an engine's layer), ``stacked.py`` (per-expert weights seen as one stacked tensor)."""
