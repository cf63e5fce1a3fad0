"""The sizes of a user's transformers config.json, checked before any model is built from it: a value no
model can be built from is refused in one line naming key and value, where transformers would fail deep
inside (a division by zero, a top-k beyond its experts) or take hours to build it."""
from __future__ import annotations

import math
from pathlib import Path

from placement.names import MAX_EXPERTS

# config keys that must be positive integers: every model's, then those a model may leave out
NEEDED_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
OTHER_SIZES = ("num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
               "max_position_embeddings", "num_experts_per_tok", "n_group", "topk_group")
EXPERT_COUNTS = ("n_routed_experts", "num_local_experts", "num_experts")  # the expert count, by model family
EPS_KEYS = ("rms_norm_eps", "layer_norm_eps")
# counting the parameters builds every layer on the meta device (about 1 ms each: 200,000 layers took
# minutes); published models have fewer than 200
MAX_LAYERS = 1024


def check_config(folder: Path, config) -> None:
    """Refuse, naming key and value, a config.json whose sizes no model can be built from: transformers
    would fail deep inside (a division by zero, a top-k beyond its experts) or take hours to build it."""
    has = f"model.path={str(folder)!r}: its config.json has"
    _check_finite(has, config.to_dict())
    for key in NEEDED_SIZES:
        if getattr(config, key, None) is None:
            raise ValueError(f"model.path={str(folder)!r}: its config.json has no {key}")
    for key in (*NEEDED_SIZES, *OTHER_SIZES, *EXPERT_COUNTS):
        value = getattr(config, key, None)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{has} {key}={value!r}{_aka(config, key)}: it must be a positive integer")
    for key in EPS_KEYS:
        value = getattr(config, key, None)
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{has} {key}={value!r}: it must be a positive number")
    if config.num_hidden_layers > MAX_LAYERS:
        raise ValueError(f"{has} num_hidden_layers={config.num_hidden_layers}: dist-moe builds at most {MAX_LAYERS}")
    _check_heads(has, config)
    _check_experts(has, config)


def _check_finite(has: str, values: dict, prefix: str = "") -> None:
    """Every number of the config (nested ones, as ``rope_parameters``', included) is finite."""
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{has} {prefix}{key}={value}: every number in it must be finite")
        if isinstance(value, dict) and not prefix:  # one level down: the config's own sections
            _check_finite(has, value, f"{key}.")


def _aka(config, key: str) -> str:
    """The other names config.json may give ``key`` (Qwen3-MoE's ``num_experts`` is ``num_local_experts``)."""
    aliases = sorted(alias for alias, name in getattr(config, "attribute_map", {}).items() if name == key)
    return f" (or {', '.join(aliases)})" if aliases else ""


def _check_heads(has: str, config) -> None:
    heads, hidden = config.num_attention_heads, config.hidden_size
    if heads > hidden:
        raise ValueError(f"{has} num_attention_heads={heads}, more heads than hidden_size={hidden}")
    if getattr(config, "head_dim", None) is None and hidden % heads:  # each head takes hidden_size / heads
        raise ValueError(f"{has} num_attention_heads={heads}, which does not divide hidden_size={hidden} (and no "
                         "head_dim)")
    kv = getattr(config, "num_key_value_heads", None)
    if kv is not None and heads % kv:  # each key/value head serves heads / kv query heads
        raise ValueError(f"{has} num_key_value_heads={kv}, which does not divide num_attention_heads={heads}")


def _check_experts(has: str, config) -> None:
    key = next((k for k in EXPERT_COUNTS if getattr(config, k, None) is not None), None)
    if key is None:
        return  # no experts: load_model refuses the model by its class
    experts, k = getattr(config, key), getattr(config, "num_experts_per_tok", None)
    if experts > MAX_EXPERTS:
        raise ValueError(f"{has} {key}={experts}{_aka(config, key)}: dist-moe hosts at most {MAX_EXPERTS} experts")
    if k is not None and k > experts:
        raise ValueError(f"{has} num_experts_per_tok={k}, more than its {experts} experts ({key})")
    groups, chosen = getattr(config, "n_group", None), getattr(config, "topk_group", None)
    if groups is None or chosen is None:
        return
    # DeepSeek-V3's router: experts in n_group equal groups, each scored by its best two, topk_group kept
    if experts % groups or experts // groups < 2:
        raise ValueError(f"{has} n_group={groups}, which does not cut its {experts} experts ({key}) into equal "
                         "groups of at least 2")
    if chosen > groups:
        raise ValueError(f"{has} topk_group={chosen}, more than n_group={groups}")
    if k is not None and k > chosen * (experts // groups):
        raise ValueError(f"{has} num_experts_per_tok={k}, more than the {chosen * (experts // groups)} experts of "
                         f"its topk_group={chosen} groups")
