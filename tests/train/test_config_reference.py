"""docs/configuration.md is the schema's own account of every key: written by
``python -m dist_moe.train.config_reference``, and out of date the moment a key, default, rule or
comment changes without it."""
import re
from pathlib import Path

from dist_moe.routing.registry import ROUTERS, config_class
from dist_moe.train.config import _leaves, load_config
from dist_moe.train.config_reference import page

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_configuration_page_is_what_the_schema_writes():
    assert PAGE.read_text() == page(), "docs/configuration.md is out of date: " \
        ".venv/bin/python -m dist_moe.train.config_reference > docs/configuration.md"


def test_every_key_and_default_is_on_the_page():
    text = PAGE.read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w.]+)` \| [^|]*(?:\\\|[^|]*)* \| ([^|]*) \|", text,
                                                        re.M)}
    defaults = _leaves(load_config(None, []).to_dict(full=True))
    for key, value in defaults.items():
        if key.startswith("router."):
            continue  # below, per router type
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        assert rows.get(key, "").strip() == shown, (key, rows.get(key), shown)
    for kind in ROUTERS:
        section = text.split(f"### `router.type: {kind}`", 1)[1].split("\n### ", 1)[0]
        for f in config_class(kind).__dataclass_fields__:
            assert f"| `router.{f}` |" in section, (kind, f)
    for gar_key in ("lambda", "eps", "mode", "unit", "share"):
        assert f"| `train.gar.{gar_key}` |" in text
