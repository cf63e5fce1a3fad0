"""Reading the package's YAML and .npz files (configs, topologies, placements, routing records, data caches)
with errors that name the file and the problem, and writing files in place of others without following a
planted link."""
from __future__ import annotations

import contextlib
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
