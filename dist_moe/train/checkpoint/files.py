"""What a checkpoint load may read: files its manifest lists, checked, and nothing else.

A checkpoint directory is flat: DCP's ``.metadata`` and ``__<rank>_<i>.distcp`` shards, the
run's ``config.json`` and ``manifest.json`` (the size and SHA-256 of every other file). Anyone
who can write the directory can also rewrite the manifest, so the manifest only proves that
nothing changed by accident; what keeps a crafted checkpoint from running code or reading
elsewhere is what ``verify`` refuses:

- any entry that is not a regular file (a symlink, a FIFO, a device, a subdirectory), any
  file the manifest does not list, any file over its size limit: nothing blocks or escapes;
- a ``.metadata`` pickle with a global outside an exact (module, name) allow-list: it is
  unpickled here, once, from the bytes that were hashed, and DCP gets that object;
- metadata that declares a bytes entry (DCP would ``torch.load`` it with
  ``weights_only=False``: a pickle that runs code) or a storage path that is not one of
  the listed files (absolute, ``../``, inside a subdirectory) or a transform: dist-moe
  writes none of these.

DCP then opens shards only through ``checkpoint_dcp.CheckedFileSystem``, which accepts a listed file alone
and only if it is still the very file that was hashed (same inode, size and ctime).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from placement import write_atomic

MANIFEST = "manifest.json"
CONFIG = "config.json"  # the run's config at the save: a resume that would change the model is refused
METADATA = ".metadata"
SMALL_FILE_LIMIT = 16 << 20  # manifest.json, config.json, the `latest` pointer: text files, never this big
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*|\.metadata")  # DCP's and ours: flat, no path
_JSON_DEPTH = 32


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted: incomplete, truncated, corrupted or foreign."""


@dataclass(frozen=True)
class Identity:
    """Which file was hashed: a reader that opens anything else is refused."""
    dev: int
    ino: int
    size: int
    ctime_ns: int

    @staticmethod
    def of(st: os.stat_result) -> Identity:
        return Identity(st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns)


@contextlib.contextmanager
def open_regular(path: Path, limit: int | None = None):
    """A read-only file object for ``path`` if it is a regular file (not a symlink, FIFO or
    device: O_NONBLOCK keeps a FIFO from blocking the open) of at most ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        what = "is a symlink" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})"
        raise CheckpointError(f"checkpoint file {path} {what}") from None
    f = os.fdopen(fd, "rb")
    with f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"checkpoint file {path} is not a regular file")
        if limit is not None and st.st_size > limit:
            raise CheckpointError(f"checkpoint file {path} is {st.st_size} bytes, over its limit of {limit}")
        os.set_blocking(fd, True)
        yield f


def read_regular(path: Path, limit: int) -> bytes:
    with open_regular(path, limit) as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:  # it grew after the size check
        raise CheckpointError(f"checkpoint file {path} is over its limit of {limit} bytes")
    return raw


def read_json(path: Path, raw: bytes | None = None):
    """Parsed JSON of a small checkpoint file, refusing text nested deeper than any file dist-moe writes."""
    raw = read_regular(path, SMALL_FILE_LIMIT) if raw is None else raw
    try:
        text = raw.decode("utf-8")
        if _depth(text) > _JSON_DEPTH:
            raise ValueError(f"nested deeper than {_JSON_DEPTH} levels")
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"checkpoint file {path} is not readable JSON ({str(e)[:200]})") from None


def _depth(text: str) -> int:
    """The deepest bracket nesting outside strings: json.loads would recurse that deep."""
    deepest = depth = 0
    for token in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text):
        t = token.group()
        if t in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif t in "]}":
            depth -= 1
    return deepest


def _listing(path: Path) -> dict[str, os.stat_result]:
    """Every entry of the checkpoint directory (lstat: a symlink is seen as one), all regular files."""
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory (a symlink or a file)")
    entries = {}
    with os.scandir(path) as it:
        for entry in it:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                raise CheckpointError(f"checkpoint {path} holds {entry.name!r}, {kind}: a checkpoint holds "
                                      "regular files only")
            entries[entry.name] = st
    return entries


def write_manifest(path: Path, files: dict[str, dict]) -> None:
    """Write the manifest of ``path`` from ``files`` (every rank's hashes of its own files, ``hashing``), which
    must name every file there and nothing else: a file no rank hashed is refused, never hashed here."""
    present = set(_listing(path)) - {MANIFEST}
    if set(files) != present:
        raise CheckpointError(f"checkpoint {path}: the ranks hashed {sorted(files)[:10]}, the directory holds "
                              f"{sorted(present)[:10]}")
    listed = dict(sorted(files.items()))
    write_atomic(path / MANIFEST, json.dumps({"format": 1, "files": listed}, indent=1) + "\n", 0o600)


def _sha256(f) -> str:
    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def manifest_files(path: Path) -> dict[str, dict]:
    """The manifest's ``files``: {plain file name: {"bytes": int, "sha256": hex}}, or CheckpointError."""
    if not (path / MANIFEST).exists() and not (path / MANIFEST).is_symlink():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: an incomplete save, or not written by dist-moe")
    manifest = read_json(path / MANIFEST)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a mapping with a 'files' mapping")
    for name, want in files.items():
        if not _FILE_NAME.fullmatch(name) or name == MANIFEST:
            raise CheckpointError(f"checkpoint {path}: its manifest names {name[:80]!r}, not a file of the checkpoint "
                                  "(a path outside it, or inside a subdirectory)")
        ok = (isinstance(want, dict) and isinstance(want.get("bytes"), int) and not isinstance(want["bytes"], bool)
              and want["bytes"] >= 0 and isinstance(want.get("sha256"), str))
        if not ok:
            raise CheckpointError(f"checkpoint {path}: its manifest entry for {name!r} is not "
                                  "{\"bytes\": <int>, \"sha256\": <hex>}")
    return files


def checked_bytes(path: Path, name: str, files: dict[str, dict], limit: int) -> bytes:
    """One small listed file's bytes, checked against the manifest (read once: what is checked is what is used)."""
    if name not in files:
        raise CheckpointError(f"checkpoint {path}: its manifest does not list {name}")
    raw = read_regular(path / name, limit)
    _check(path, name, files[name], len(raw), hashlib.sha256(raw).hexdigest())
    return raw


def _check(path: Path, name: str, want: dict, size: int, digest: str) -> None:
    if size != want["bytes"]:
        raise CheckpointError(f"checkpoint {path}: {name} is {size} bytes, the manifest says {want['bytes']} "
                              "(truncated or overwritten)")
    if digest != want["sha256"]:
        raise CheckpointError(f"checkpoint {path}: {name} fails its SHA-256 check (corrupted)")


def verify(path: str | Path):
    """Check the checkpoint ``path`` (see the module's docstring); returns (DCP's Metadata, unpickled
    from the very bytes that were hashed, and the identity of every file that was checked, for
    ``CheckedFileSystem``). Raises ``CheckpointError`` on anything it does not trust, reading nothing
    that is not a listed regular file."""
    path = Path(path)
    files = manifest_files(path)
    present = _listing(path)
    extra = sorted(set(present) - set(files) - {MANIFEST})
    if extra:
        raise CheckpointError(f"checkpoint {path} holds files its manifest does not list: {extra[:10]}")
    if METADATA not in files:
        raise CheckpointError(f"checkpoint {path} has no {METADATA} (not a DCP checkpoint)")
    identities, metadata = {}, None
    for name, want in files.items():
        if name not in present:
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        with open_regular(path / name, want["bytes"]) as f:
            st = os.fstat(f.fileno())
            if name == METADATA:
                raw = f.read()
                digest = hashlib.sha256(raw).hexdigest()
            else:
                digest = _sha256(f)
            _check(path, name, want, st.st_size, digest)
            identities[name] = Identity.of(st)
        if name == METADATA:
            metadata = _unpickle_metadata(raw, path)
    check_metadata(metadata, {n: files[n]["bytes"] for n in files}, path)
    return metadata, identities


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DTYPES = ("float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64", "int32", "int16",
           "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2")
# Exact (module, qualified name) pairs: what torch 2.13's DCP writes into .metadata, nothing else.
# A name is never resolved through a module's namespace: (_DCP_METADATA, "os.system") is refused.
# BytesStorageMetadata unpickles (so the refusal can name the entry) and is then refused by check_metadata.
SAFE_GLOBALS = frozenset({
    *((_DCP_METADATA, n) for n in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                                   "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
                                   "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
    ("torch", "Size"), *(("torch", d) for d in _DTYPES), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in SAFE_GLOBALS:
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to unpickle {module}.{name} (module {module!r}, name {name!r}) from a "
                              "checkpoint's .metadata: DCP metadata holds only its own classes, dtypes, sizes and "
                              "paths")

    def persistent_load(self, pid):
        raise CheckpointError(f"refusing a persistent id in a checkpoint's .metadata ({str(pid)[:80]!r})")


def _unpickle_metadata(raw: bytes, where: Path):
    """DCP's Metadata from the bytes that were checked; nothing outside SAFE_GLOBALS is ever called."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {where}: {e}") from None
    except Exception as e:  # a truncated or garbled pickle
        raise CheckpointError(f"checkpoint {where}: .metadata does not unpickle ({str(e)[:200]})") from None
    if type(metadata).__name__ != "Metadata" or type(metadata).__module__ != _DCP_METADATA:
        raise CheckpointError(f"checkpoint {where}: .metadata holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def check_metadata(metadata, sizes: dict[str, int], where: Path) -> None:
    """Refuse what dist-moe never writes: bytes entries (DCP unpickles them with weights_only=False),
    storage outside the listed shards (absolute, ``../``, a subdirectory, a file not in the manifest),
    ranges past a shard's end, stream transforms."""
    # torch.distributed.checkpoint: ~1.6 s to import, only when a checkpoint is read
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise CheckpointError(f"checkpoint {where}: .metadata's state_dict_metadata is not a mapping")
    for key, entry in entries.items():
        if type(entry) is BytesStorageMetadata and isinstance(key, str) and key.endswith("._extra_state"):
            continue  # Megatron's None extra state, as dist-moe saved it until 2026-12: never requested, never read
        if type(entry) is not TensorStorageMetadata:
            raise CheckpointError(f"checkpoint {where}: .metadata declares {str(key)[:80]!r} as "
                                  f"{type(entry).__name__}: dist-moe checkpoints hold tensors only (a bytes entry "
                                  "is a pickle that DCP would load and run)")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"checkpoint {where}: .metadata's storage_data is not a mapping")
    shards = {n: s for n, s in sizes.items() if n not in (METADATA, CONFIG, MANIFEST)}
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo or index.fqn not in entries:
            raise CheckpointError(f"checkpoint {where}: .metadata's storage_data holds an entry that is not a "
                                  "(MetadataIndex of a declared tensor, _StorageInfo) pair")
        name, offset, length = info.relative_path, info.offset, info.length
        if not isinstance(name, str) or name not in shards:
            raise CheckpointError(f"checkpoint {where}: .metadata stores {index.fqn[:80]!r} in {str(name)[:120]!r}, "
                                  "not a shard of this checkpoint's manifest (a path outside it)")
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, length))
        if not ints or offset < 0 or length < 0 or offset + length > shards[name]:
            raise CheckpointError(f"checkpoint {where}: .metadata stores {index.fqn[:80]!r} at bytes "
                                  f"{offset!r}+{length!r} of {name}, outside its {shards[name]} bytes")
        if info.transform_descriptors:
            raise CheckpointError(f"checkpoint {where}: .metadata stores {index.fqn[:80]!r} through stream "
                                  f"transforms {list(info.transform_descriptors)[:4]}: dist-moe writes none")
