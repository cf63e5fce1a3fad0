"""Checkpoints with torch.distributed.checkpoint: atomic, resumable, resharding across EP sizes.

Layout under ``DIR``: ``step-<N>/`` (a DCP checkpoint) and ``latest`` (the name of
the newest complete one). A save writes ``.tmp-step-<N>/`` and renames it once
every rank has finished, then replaces ``latest``; a crash mid-save leaves a
``.tmp-`` directory that is never loaded. Before the rename rank 0 writes
``manifest.json``: the size and SHA-256 of every file DCP wrote. Every load checks
it first (each rank, so all ranks agree before any collective), and a missing,
truncated, corrupted or unexpected file is a clear error with nothing loaded.
Checkpoint directories are 0700 and their files 0600: they hold the run's state.
DCP pickles its ``.metadata``: its bytes are read once, checked against the manifest and
unpickled here against an exact allow-list of (module, name) pairs (DCP's metadata
classes, torch dtypes and sizes, paths); DCP gets that object and never opens the file,
so a planted pickle is refused instead of run, and nothing can swap the file between
the check and the read.

What is saved: the model state (router buffers included: BRANCH anchors and EMA
step, DeepSeek-V3 biases, SpecDrop progress), Adam state, each rank's RNG state
and the data position (step, and the data-order generator's state at the start
of the current epoch). Expert tensors are split per expert and keyed by global
expert id (``moe.experts.w_gate.expert5``), for parameters and their optimizer
state alike, so a checkpoint saved with one expert-parallel size and placement
loads with another: each rank asks DCP for the experts it now holds. RNG states
restore only at the same world size (elsewhere the ranks keep their fresh
streams). Tensors only: loading never unpickles objects.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch import nn

from dist_moe.dispatch.process_group import barrier

LATEST = "latest"
MANIFEST = "manifest.json"
CONFIG = "config.json"  # the run's config at the save: a resume that would change the model is refused
_STEP_NAME = re.compile(r"step-[0-9]+")


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted: incomplete, truncated, corrupted or foreign."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(path: Path) -> None:
    """Record size and SHA-256 of every file under ``path`` (rank 0, once DCP is done)."""
    files = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST):
        os.chmod(f, 0o600)
        files[str(f.relative_to(path))] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    tmp = path / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"format": 1, "files": files}, indent=1) + "\n")
    os.chmod(tmp, 0o600)
    tmp.replace(path / MANIFEST)


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DTYPES = ("float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64", "int32", "int16",
           "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2")
# Exact (module, qualified name) pairs: what torch 2.13's DCP writes into .metadata, nothing else.
# A name is never resolved through a module's namespace: (_DCP_METADATA, "os.system") is refused.
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
        raise CheckpointError(f"checkpoint {where}: .metadata does not unpickle ({e})") from None
    if type(metadata).__name__ != "Metadata" or type(metadata).__module__ != _DCP_METADATA:
        raise CheckpointError(f"checkpoint {where}: .metadata holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def verify(path: str | Path):
    """Check every file against the manifest; returns DCP's Metadata, unpickled (allow-listed) from
    the very bytes whose SHA-256 was checked, for ``load`` to hand to DCP: the file is read once and
    never unpickled by code that has not checked it. Raises ``CheckpointError`` on any mismatch."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: an incomplete save, or not written by dist-moe")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({e})") from None
    present = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != MANIFEST}
    extra = sorted(present - set(files))
    if extra:
        raise CheckpointError(f"checkpoint {path} holds files its manifest does not list: {extra}")
    if ".metadata" not in files:
        raise CheckpointError(f"checkpoint {path} has no .metadata (not a DCP checkpoint)")
    metadata = None
    root = path.resolve()
    for name, want in files.items():
        f = path / name
        if Path(name).is_absolute() or ".." in Path(name).parts or root not in f.resolve().parents:
            raise CheckpointError(f"checkpoint {path}: its manifest names {name!r}, outside the checkpoint")
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        raw = f.read_bytes() if name == ".metadata" else None  # the bytes DCP will get
        size = len(raw) if raw is not None else f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {name} is {size} bytes, the manifest says {want['bytes']} "
                                  "(truncated or overwritten)")
        digest = hashlib.sha256(raw).hexdigest() if raw is not None else _sha256(f)
        if digest != want["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} fails its SHA-256 check (corrupted)")
        if raw is not None:
            metadata = _unpickle_metadata(raw, path)
    return metadata


class _VerifiedReader(dcp.FileSystemReader):
    """DCP's file reader, handed the Metadata ``verify`` unpickled instead of reading .metadata itself."""

    def __init__(self, path: Path, metadata):
        super().__init__(str(path))
        self._verified = metadata

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"checkpoint {self.path}: per-rank metadata files are not read")
        metadata = copy.deepcopy(self._verified)  # DCP stamps its load id into it
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _expert_keys(model: nn.Module) -> dict[str, tuple[list[int], str, bool]]:
    """state-dict key of each expert tensor -> (global expert ids, key stem, stacked).

    dist-moe's experts are stacked [E_local, ...] (``stacked``: row j is expert ids[j]);
    DeepSpeed's copies are [1, ...] each; Megatron's are one plain tensor per expert. The
    stem is ``<layer>.experts.<slot>`` for every host, so checkpoints name experts alike.
    """
    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "expert_state_keys"):  # MoELayer and the engine-hosted layers say where theirs are
            out.update(m.expert_state_keys(f"{name}." if name else ""))
    return out


def _split(stem: str, t: torch.Tensor, ids: list[int], stacked: bool) -> dict[str, torch.Tensor]:
    if not stacked:
        return {f"{stem}.expert{ids[0]}": t}
    return {f"{stem}.expert{e}": t[j] for j, e in enumerate(ids)}


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, torch.Tensor]) -> dict:
    """The flat, tensor-only dict this rank saves (and, with fresh tensors, loads into)."""
    experts = _expert_keys(model)
    state = {}
    for key, t in model.state_dict().items():
        if key in experts:
            ids, stem, stacked = experts[key]
            state.update(_split(f"model.{stem}", t, ids, stacked))
        else:
            state[f"model.{key}"] = t
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in optimizer.state.items():
        name = names[id(p)]
        for k, v in s.items():
            v = v if torch.is_tensor(v) else torch.tensor(v)
            if name in experts and v.dim() > 0:
                ids, stem, stacked = experts[name]
                state.update(_split(f"optim.{stem}.{k}", v, ids, stacked))
            elif name in experts:  # a scalar (Adam's step) shared by the stacked experts: one per expert
                ids, stem, _ = experts[name]
                state.update({f"optim.{stem}.{k}.expert{e}": v.clone() for e in ids})
            else:
                state[f"optim.{name}.{k}"] = v
    state.update(extra)
    return state


def save(directory: str | Path, step: int, model: nn.Module, optimizer, extra: dict, group=None,
         config: dict | None = None) -> Path:
    """Write ``step-<step>`` atomically (every rank calls this); returns its path. ``config``, the
    run's config, is kept beside the tensors (``saved_config``)."""
    directory = Path(directory)
    final = directory / f"step-{step}"
    tmp = directory / f".tmp-step-{step}"
    if _rank(group) == 0:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        shutil.rmtree(tmp, ignore_errors=True)  # a save that died earlier
        tmp.mkdir(mode=0o700)
    barrier(group)
    _materialise_optimizer_state(model, optimizer)  # a save before the first step still loads
    with _unwrapped():
        dcp.save(state_of(model, optimizer, extra), checkpoint_id=tmp, process_group=group, no_dist=group is None)
    barrier(group)
    if _rank(group) == 0:
        if config is not None:
            (tmp / CONFIG).write_text(json.dumps(config, indent=1, default=str) + "\n")
        write_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        pointer = directory / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.chmod(pointer, 0o600)
        pointer.replace(directory / LATEST)
    barrier(group)
    return final


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory``, or None. ``latest`` may only name a
    ``step-<N>`` directory of this very directory (no path, no link out of it)."""
    directory = Path(directory)
    pointer = directory / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text(errors="replace").strip()
    path = directory / name
    if not _STEP_NAME.fullmatch(name) or path.resolve().parent != directory.resolve():
        raise CheckpointError(f"{pointer} names {name[:80]!r}, not a step-<N> checkpoint of {directory}")
    if not path.is_dir():
        raise CheckpointError(f"{pointer} names {name}, which does not exist")
    return path


def saved_config(path: str | Path) -> dict | None:
    """The run config a checkpoint was saved with (None for checkpoints written before it was kept)."""
    f = Path(path) / CONFIG
    return json.loads(f.read_text()) if f.is_file() else None


def load(path: str | Path, model: nn.Module, optimizer, extra: dict, group=None) -> dict:
    """Fill ``model``, ``optimizer`` (its state created by one zero step first) and the tensors
    in ``extra`` from ``path``; keys in ``extra`` missing from the checkpoint are left as they are.
    The manifest is checked first: a damaged checkpoint raises ``CheckpointError`` and loads nothing."""
    metadata = verify(path)
    _materialise_optimizer_state(model, optimizer)
    state = state_of(model, optimizer, {})
    present = set(metadata.state_dict_metadata)
    missing = sorted(k for k in state if k not in present)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} entries this model needs, e.g. {missing[0]!r} "
                         "(another model, or experts this checkpoint never held)")
    wanted = {k: v for k, v in extra.items() if k in present}
    try:
        with _unwrapped():
            dcp.load({**state, **wanted}, storage_reader=_VerifiedReader(Path(path), metadata), process_group=group,
                     no_dist=group is None)
        _write_back(model, optimizer, state)
    except (RuntimeError, AssertionError, ValueError) as e:  # DCP's and load_state_dict's size checks
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, CheckpointError) or not any(w in str(e).lower() for w in ("size", "shape", "mismatch")):
            raise
        raise CheckpointError(f"checkpoint {path} does not fit this model ({first[:300]}): another model size, "
                              "router or expert count than the run that saved it") from None
    return wanted


@contextlib.contextmanager
def _unwrapped():
    """DCP wraps every rank's failure in a CheckpointException, a BaseException whose text is a
    traceback: raise the first rank's own exception instead (an OSError, a size mismatch, ...)."""
    try:
        yield
    except CheckpointException as e:
        inner = next((exc for exc, _ in e.failures.values() if isinstance(exc, Exception)), None)
        if inner is None:
            raise
        raise inner from None


def _materialise_optimizer_state(model: nn.Module, optimizer) -> None:
    """Adam creates its state lazily; give every parameter its (zero) state to load into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p not in optimizer.state:
                optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def _write_back(model: nn.Module, optimizer, state: dict) -> None:
    experts = _expert_keys(model)
    model_state = {}
    for key, t in model.state_dict().items():
        if key in experts:
            ids, stem, stacked = experts[key]
            rows = [state[f"model.{stem}.expert{e}"] for e in ids]
            model_state[key] = torch.stack(rows) if stacked else rows[0]
        else:
            model_state[key] = state[f"model.{key}"]
    model.load_state_dict(model_state)
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in optimizer.state.items():
        name = names[id(p)]
        for k, v in s.items():
            if name in experts and v.dim() == 0:  # Adam's step: loaded into one copy per expert
                ids, stem, _ = experts[name]
                v.copy_(state[f"optim.{stem}.{k}.expert{ids[0]}"])
            # every other tensor was loaded in place (expert rows are views of the stacked state)


def _rank(group) -> int:
    return 0 if group is None else torch.distributed.get_rank(group)
