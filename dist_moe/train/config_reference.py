"""The configuration reference (docs/configuration.md), written from the schema itself: every key of
every section with its type, its default, the rule its value keeps and the comment the schema gives
it; every router type's keys from its constructor. A test fails when the page and the schema differ.

    .venv/bin/python -m dist_moe.train.config_reference > docs/configuration.md
"""
from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize
from dataclasses import MISSING, fields, is_dataclass

from dist_moe.config.types import hints
from dist_moe.routing.gar import GARConfig
from dist_moe.routing.registry import ROUTERS, config_class
from dist_moe.train.run_config import DEFAULT_ROUTER, GIVEN_LATER, RunConfig, verbatim_keys

HEAD = """# Configuration

Every key a training config takes (`dist-moe train --config FILE.yaml key=value ...`), by section:
its type, its default, the rule a value must keep, and what it does. A YAML file sets any of them
(`parallel: {dedup: node}`); an override sets one (`parallel.dedup=node`); a key that is not here,
or a value that breaks its rule, stops the run before anything starts, with one line naming it.
An override's value is read as YAML (`train.lr=3e-4` is a number, `train.gar=null` is null), except
for the keys that name a path or a name (VERBATIM): those
take the text after `=` as written, so `output.dir='runs/a #b'` is `runs/a #b`. An empty value is null
for every key. `output.dir` fills in `{name}` and no other field.

This page is written from the schema (`dist_moe/train/run_config.py`, and each router's
constructor): `.venv/bin/python -m dist_moe.train.config_reference > docs/configuration.md`
rewrites it, and a test fails when the two differ.
"""


def page() -> str:
    """The whole page, as markdown."""
    head = HEAD.replace("VERBATIM", ", ".join(f"`{k}`" for k in sorted(verbatim_keys())))
    out = [head, "## Top level\n", _table(RunConfig, skip_sections=True)]
    types = hints(RunConfig)
    for f in fields(RunConfig):
        if f.name == "router":
            out.append(_routers())
        elif is_dataclass(types[f.name]):
            section = types[f.name]
            doc = inspect.getdoc(section) if section.__doc__ and not section.__doc__.startswith(section.__name__) \
                else ""
            out += [f"## `{f.name}`\n", f"{doc}\n" if doc else "", _table(section, prefix=f"{f.name}.")]
            if f.name == "train":
                out += ["### `train.gar`\n", "GAR's settings; null (the default): no GAR.\n",
                        _table(GARConfig, prefix="train.gar.", names={v: k for k, v in GARConfig._KEYS.items()})]
    return "\n".join(part for part in out if part).rstrip() + "\n"


def _table(cls, prefix: str = "", skip_sections: bool = False, names: dict | None = None) -> str:
    comments, types = _comments(cls), hints(cls)
    rows = ["| key | type | default | rule | what it does |", "|---|---|---|---|---|"]
    for f in fields(cls):
        if f.name.startswith("_"):
            continue
        kind = types[f.name]
        if skip_sections and (is_dataclass(kind) or f.name == "router"):
            continue
        default = f.default if f.default is not MISSING else "(a section)"
        rule = (f.metadata.get("rule") or (None, None))[0] or ""
        key = (names or {}).get(f.name, f.name)
        rows.append(f"| `{prefix}{key}` | {_cell(_type_name(kind))} | {_cell(_shown(default))} | {_cell(rule)} "
                    f"| {_cell(comments.get(f.name, ''))} |")
    return "\n".join(rows) + "\n"


def _routers() -> str:
    """The router section: ``type`` picks the strategy, whose constructor gives the other keys."""
    out = ["## `router`\n",
           f"`router.type` picks the routing strategy (one of {', '.join(f'`{k}`' for k in ROUTERS)}; default "
           f"`{DEFAULT_ROUTER['type']}`, {', '.join(f'{k} {v}' for k, v in DEFAULT_ROUTER.items() if k != 'type')}); "
           "its other keys are that strategy's constructor parameters. A key without a default must be given, "
           f"except {' and '.join(f'`{k}`' for k in GIVEN_LATER)}, which a training run takes from its model and its "
           "data.\n"]
    for kind in ROUTERS:
        doc = inspect.cleandoc(ROUTERS[kind].__dict__.get("__doc__") or "")  # its own, not a base class's
        out += [f"### `router.type: {kind}`\n", f"{doc.split(chr(10) + chr(10))[0]}\n" if doc else "",
                "| key | type | default |", "|---|---|---|"]
        for f in fields(config_class(kind)):
            required = f.default is None and _required(kind, f.name)
            default = "given by the run" if f.name in GIVEN_LATER and required else \
                "(required)" if required else _shown(f.default)
            out.append(f"| `router.{f.name}` | {_cell(_type_name(f.type))} | {_cell(default)} |")
        out.append("")
    return "\n".join(out)


def _required(kind: str, name: str) -> bool:
    param = inspect.signature(ROUTERS[kind].__init__).parameters.get(name)
    return param is not None and param.default is inspect.Parameter.empty


def _comments(cls) -> dict[str, str]:
    """Each field's comment in the class's source: the comment lines right above it and the one after it."""
    source = textwrap.dedent(inspect.getsource(cls))
    notes: dict[int, str] = {}
    alone: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            notes[tok.start[0]] = tok.string.lstrip("#").strip()
            if not tok.line[:tok.start[1]].strip():
                alone.add(tok.start[0])
    out = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, line = [], node.lineno - 1
            while line in alone:
                above.insert(0, notes[line])
                line -= 1
            after = [notes[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in notes
                     and n not in alone]
            out[node.target.id] = " ".join(above + after)
    return out


def _type_name(kind) -> str:
    if kind is None:
        return "any"
    if isinstance(kind, type):
        return kind.__name__
    return str(kind).replace("typing.", "").replace("NoneType", "None").replace("dist_moe.routing.gar.", "")


def _shown(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    print(page(), end="")
