"""Reading the package's YAML and .npz files (configs, topologies, placements, routing records, data caches)
with errors that name the file and the problem, and writing files in place of others without following a
planted link."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np
import yaml

MAX_YAML_BYTES = 1 << 20  # 1 MiB: a config or placement is kilobytes (65,536 experts' placement: ~0.5 MB)
MAX_YAML_DEPTH = 50  # nesting levels; a config has 4
MAX_YAML_NODES = 1_000_000  # values once every alias is expanded


class _Loader(yaml.SafeLoader):
    """``yaml.safe_load`` with the limits a file from a user needs: a billion-laughs alias chain, a
    nesting deeper than Python's stack, or a duplicate key (YAML keeps the last one silently) are
    refused with the line they are on, before anything walks the data."""

    _depth = 0

    def compose_node(self, parent, index):
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                                              self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        _check_expanded(node)
        return node

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue  # '<<' merges (its keys may be overridden); a complex key cannot repeat a plain one
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _check_expanded(root) -> None:
    """Refuse a document whose aliases expand to more than MAX_YAML_NODES values, nest deeper than
    MAX_YAML_DEPTH, or refer to the node that holds them (counted on the node graph, never expanded)."""
    done: dict[int, tuple[int, int]] = {}  # id(node) -> (values, height)
    active: set[int] = set()

    def walk(node, depth: int) -> tuple[int, int]:
        if depth > MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"aliases nest it deeper than {MAX_YAML_DEPTH} levels",
                                              node.start_mark)
        key = id(node)
        if key in done:
            count, height = done[key]
            if depth + height - 1 > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"aliases nest it deeper than {MAX_YAML_DEPTH} "
                                                  "levels", node.start_mark)
            return count, height
        if key in active:
            raise yaml.composer.ComposerError(None, None, "an alias refers to the value that holds it",
                                              node.start_mark)
        children = (node.value if isinstance(node, yaml.SequenceNode) else
                    [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
        active.add(key)
        count, height = 1, 0
        for child in children:
            c, h = walk(child, depth + 1)
            count, height = count + c, max(height, h)
            if count > MAX_YAML_NODES:
                raise yaml.composer.ComposerError(None, None, f"aliases expand it to more than {MAX_YAML_NODES} "
                                                  "values", node.start_mark)
        active.discard(key)
        done[key] = count, height + 1
        return done[key]

    if root is not None:
        walk(root, 1)


# YAML 1.1 reads '3e-4' as a string; accept it as a float like every ML config does
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."),
)


def parse_yaml(text: str):
    return yaml.load(text, Loader=_Loader)


def yaml_problem(e: yaml.YAMLError) -> str:
    """A parser error in one line: what, and where (the message PyYAML prints spans four)."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        context = f"{e.context} " if e.context else ""
        mark = e.problem_mark
        return f"{context}{e.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return str(e)


def read_yaml(path, what: str):
    """The parsed content of a YAML file of at most MAX_YAML_BYTES, or a ValueError naming the file."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{what} file {str(path)!r} does not exist")
    if not path.is_file():  # a FIFO or /dev/zero would never end
        raise ValueError(f"{what} path {str(path)!r} is not a file")
    with open(path, "rb") as f:
        raw = f.read(MAX_YAML_BYTES + 1)
    if len(raw) > MAX_YAML_BYTES:
        raise ValueError(f"{what} file {str(path)!r} is larger than {MAX_YAML_BYTES >> 20} MiB, the most a "
                         f"{what} file may hold (they are kilobytes): is it the right file?")
    try:
        return parse_yaml(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{what} file {str(path)!r} is not valid YAML: {yaml_problem(e)}") from None


KINDS = {"fiu": "numeric", "iu": "integer", "u": "unsigned integer", "f": "float", "U": "string"}


def read_npz(path, arrays: dict[str, tuple[str, int]], same_rows=(), what: str = "file", fix: str = "",
             optional=()) -> dict:
    """The arrays of an .npz file (read without pickle), checked: ``arrays`` gives each key's dtype kinds
    (numpy's ``dtype.kind``: "f" float, "iu" int, "U" string) and dimensions, the keys in ``same_rows`` hold
    one row per sample. Anything else (no .npz, a missing key, another type or shape) is a ValueError
    naming the file and the key; ``fix`` says what to do about it. The keys in ``optional`` may be missing;
    keys of the file not in ``arrays`` are not read."""
    path = Path(path)
    fix = f": {fix}" if fix else ""
    if not path.is_file():
        raise ValueError(f"{what} {path} is not a file{fix}")
    try:
        with np.load(path, allow_pickle=False) as z:
            found = {k: z[k] for k in z.files if k in arrays}
    except (ValueError, EOFError, zipfile.BadZipFile, zlib.error):  # np.load's view of a file that is no .npz
        raise ValueError(f"{what} {path} is not an .npz archive of arrays (or is damaged){fix}") from None
    for key, (kinds, ndim) in arrays.items():
        if key not in found and key in optional:
            continue
        if key not in found:
            raise ValueError(f"{what} {path} lacks the array {key!r}{fix}")
        a = found[key]
        if a.dtype.kind not in kinds or a.ndim != ndim:
            raise ValueError(f"{what} {path}: {key!r} must be a {ndim}-D {KINDS[kinds]} array, got a {a.ndim}-D "
                             f"{a.dtype} array of shape {a.shape}{fix}")
    rows = {key: len(found[key]) for key in same_rows}
    if len(set(rows.values())) > 1:
        raise ValueError(f"{what} {path} holds arrays of different lengths {rows}{fix}")
    return found


def read_yaml_mapping(path, what: str, required=(), optional=()) -> dict:
    """A YAML mapping with exactly the allowed keys, or a ValueError naming what is wrong."""
    data = read_yaml(path, what)
    data = {} if data is None else data
    allowed = sorted((*required, *optional))
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {path} must hold a mapping with keys {allowed}")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {what} key {str(unknown[0])[:100]!r} in {path}; valid keys: {allowed}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"{what} file {path} needs {missing[0]!r}")
    return data


def read_jsonl(path, what: str) -> tuple[list[tuple[int, dict]], int | None]:
    """The rows of a JSON-lines log as (line number, object), and the number of a torn last line
    (None if none). A process killed while writing a row leaves it half-written at the end: that
    line is skipped, as a resumed run skips it. Any other line that is no JSON object is a
    ValueError naming the file and the line. NaN, Infinity and numbers beyond a float's range (integers
    too) read as None (null), as a run logs them."""
    if not Path(path).is_file():  # a FIFO would never end
        raise ValueError(f"{what} {path} is not a file")
    lines = Path(path).read_bytes().splitlines()
    rows: list = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"), parse_constant=lambda name: None, parse_float=_finite_or_none,
                             parse_int=_int_or_none)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if number == len(lines):
                return rows, number
            raise ValueError(f"{what} {path}: line {number} is not JSON ({_json_problem(e)})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{what} {path}: line {number} must hold a JSON object, got {type(row).__name__}")
        rows.append((number, row))
    return rows, None


def _finite_or_none(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def _int_or_none(text: str) -> int | None:
    """An integer, or None beyond a float's range (Python refuses to read one of over 4,300 digits, which
    would otherwise look like a torn line)."""
    return None if len(text.lstrip("-")) > FLOAT_DIGITS else int(text)


FLOAT_DIGITS = 308  # the digits of the largest finite float


def _json_problem(e: Exception) -> str:
    """A decoder's complaint without its position inside the line, which the line number replaces."""
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text at byte {e.start}"
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at column {e.colno}"
    return type(e).__name__


def check_output_file(path, what: str, make_folders: bool = False) -> None:
    """Refuse, before any work, a file path its output could not be written to: a folder or another
    thing that is no regular file, in a folder that does not exist (``make_folders``: whose nearest
    existing folder the writer creates the rest in) or that this process may not write in."""
    path = Path(path)
    if path.exists() and not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file"
        raise ValueError(f"{what} {str(path)!r} is {kind}: give the path of a file to write")
    folder = path.parent
    while make_folders and not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.exists():
        raise ValueError(f"{what} {str(path)!r}: the folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ValueError(f"{what} {str(path)!r}: {str(folder)!r} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {str(path)!r}: the folder {str(folder)!r} is not writable")


@contextlib.contextmanager
def replacing(path, mode: int = 0o644):
    """A binary file (permissions ``mode``) that becomes ``path`` when the block ends. It is written beside
    ``path`` under a fresh name (``mkstemp``: O_EXCL, so never through a planted link) and renamed over it: a reader
    never sees half a file, and a symlink planted at ``path`` is replaced, not written through."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path, data: str | bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` (text as UTF-8), never writing through a link (``replacing``)."""
    with replacing(path, mode) as f:
        f.write(data.encode() if isinstance(data, str) else data)
