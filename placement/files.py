"""Reading the package's YAML files (topologies, placements) with errors that name the problem."""
from __future__ import annotations

from pathlib import Path

import yaml


def read_yaml_mapping(path, what: str, required=(), optional=()) -> dict:
    """A YAML mapping with exactly the allowed keys, or a ValueError naming what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{what} file {str(path)!r} is not valid YAML: {e}") from None
    allowed = sorted((*required, *optional))
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {path} must hold a mapping with keys {allowed}")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {what} key {unknown[0]!r} in {path}; valid keys: {allowed}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"{what} file {path} needs {missing[0]!r}")
    return data
