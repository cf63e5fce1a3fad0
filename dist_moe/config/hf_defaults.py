"""``model.kind: hf``: the defaults a user's transformers model brings in place of the embedded tabular demo's.

The model routes with its own router (its experts and top-k are its config.json's) and runs dropless, so a run
records no dist-moe router (``router: null``) and no capacity; it is named after the model's folder, and its
batch holds about ``TOKENS_PER_STEP`` tokens of its sequence length. A key the user gave keeps its value; a
router key refused here is named with where it was given.
"""
from __future__ import annotations

from pathlib import Path

TOKENS_PER_STEP = 2048  # per rank: a tiny model's step in about a second on a CPU core, many steps on a GPU


def given_keys(update: dict, source: str, prefix: str = "") -> dict[str, str]:
    """Every dotted key ``update`` sets, each with ``source`` (where it was given)."""
    out: dict[str, str] = {}
    for key, value in update.items():
        out[f"{prefix}{key}"] = source
        if isinstance(value, dict):
            out.update(given_keys(value, source, f"{prefix}{key}."))
    return out


def apply_hf_defaults(cfg: dict, given: dict[str, str]) -> dict:
    """``cfg`` (a merged config mapping) with model.kind hf's defaults for the keys not in ``given`` (dotted key
    -> where it was given); unchanged for another model kind."""
    model = cfg.get("model")
    if not isinstance(model, dict) or model.get("kind") != "hf":
        return cfg
    router = sorted(k for k in given if k == "router" or k.startswith("router."))
    if router and cfg.get("router") is not None:
        key = next((k for k in router if k != "router"), router[0])
        raise ValueError(f"{key} (given by {given[key]}): model.kind=hf routes with the model's own router, its "
                         "experts and top-k as its config.json sets them: remove it")
    out = {**cfg, "router": None, "model": dict(model)}
    if "model.capacity_factor" not in given:
        out["model"]["capacity_factor"] = None
    train, data = cfg.get("train"), cfg.get("data")
    seq_len = data.get("seq_len") if isinstance(data, dict) else None
    if "train.batch_size" not in given and isinstance(train, dict) and isinstance(seq_len, int) and seq_len > 0:
        out["train"] = {**train, "batch_size": max(1, TOKENS_PER_STEP // seq_len)}
    if "name" not in given and isinstance(model.get("path"), str):
        out["name"] = folder_name(model["path"])
    return out


def folder_name(path: str) -> str:
    """The model folder's name (``model.path`` names the folder or its config.json), as a run name."""
    p = Path(path).expanduser()
    if p.name == "config.json":
        p = p.parent
    name = p.name if p.name not in ("", ".", "..") else p.resolve().name
    return name.replace("..", "_").replace("\\", "_") or "hf"
