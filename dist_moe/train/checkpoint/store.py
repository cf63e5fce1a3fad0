"""Checkpoints with torch.distributed.checkpoint: atomic, resumable, resharding across EP sizes.

Layout under ``DIR``: ``step-<N>/`` (a DCP checkpoint) and ``latest`` (the name of
the newest complete one). A save writes ``.tmp-step-<N>/`` and renames it once
every rank has finished, then replaces ``latest``; a crash mid-save leaves a
``.tmp-`` directory that is never loaded. Before the rename rank 0 writes
``manifest.json``: the size and SHA-256 of every file DCP wrote, each hashed by the
rank that wrote it, right after writing it, a slice at a time between short collectives
(``hashing``: a rank done first never waits in one collective as long as a slower rank's
hash, which could outlast ``parallel.timeout_s``), and gathered in one small exchange
of (name, size, hash). Every load verifies
the checkpoint first (each rank, so all ranks agree before any collective;
``checkpoint_files`` says what is refused: unlisted, damaged or non-regular files,
pickled globals outside an allow-list, bytes entries, storage outside the listed
shards), so a damaged or crafted checkpoint is a clear error with nothing loaded,
nothing run and nothing read from elsewhere. Checkpoint directories are 0700 and
their files 0600: they hold the run's state.

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
import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dist_moe.distributed.every_rank import agree_on_errors
from dist_moe.distributed.process_group import barrier
from dist_moe.errors import first_line
from dist_moe.moe.view import MoEHost
from dist_moe.train.checkpoint.files import (
    CONFIG,
    MANIFEST,
    SAFE_GLOBALS,
    CheckpointError,
    checked_bytes,
    manifest_files,
    read_json,
    read_regular,
    verify,
    write_manifest,
)
from dist_moe.train.checkpoint.hashing import hashed_by_their_writers
from placement import write_atomic

__all__ = ["CONFIG", "LATEST", "MANIFEST", "SAFE_GLOBALS", "CheckpointError", "as_saved", "check_shared", "latest",
           "load", "save", "saved_config", "state_of", "verify", "write_manifest"]

LATEST = "latest"
_STEP_NAME = re.compile(r"step-[0-9]+")


def _expert_keys(model: nn.Module) -> dict[str, tuple[list[int], str, bool]]:
    """state-dict key of each expert tensor -> (global expert ids, key stem, stacked).

    dist-moe's experts are stacked [E_local, ...] (``stacked``: row j is expert ids[j]);
    DeepSpeed's copies are [1, ...] each; Megatron's are one plain tensor per expert. The
    stem is ``<layer>.experts.<slot>`` for every host, so checkpoints name experts alike.
    """
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, MoEHost):  # MoELayer and the engine-hosted layers say where their experts are
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
        if t is None:  # Megatron's `_extra_state` (TE compatibility): nothing to keep, and never a pickle
            continue
        if not torch.is_tensor(t):
            raise TypeError(f"model state {key!r} is a {type(t).__name__}: dist-moe checkpoints hold tensors only")
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
         config: dict | None = None, keep: int | None = None) -> Path:
    """Write ``step-<step>`` atomically (every rank calls this); returns its path. ``config``, the
    run's config, is kept beside the tensors (``saved_config``). ``keep``: once it is complete, only the
    newest ``keep`` checkpoints stay, this one always among them (None: every one)."""
    directory = Path(directory)
    final = directory / f"step-{step}"
    tmp = directory / f".tmp-step-{step}"
    _materialise_optimizer_state(model, optimizer)  # a save before the first step still loads
    state = state_of(model, optimizer, extra)
    agree_on_errors(lambda: _refuse_non_finite(state, directory, step), group)  # before anything is written
    if _rank(group) == 0:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        _remove(tmp)  # a save that died earlier
        tmp.mkdir(mode=0o700)
    barrier(group)
    from dist_moe.train.checkpoint.dcp import save_state  # torch.distributed.checkpoint: ~1.6 s to import

    written = save_state(state, tmp, group)
    if _rank(group) == 0 and config is not None:
        write_atomic(tmp / CONFIG, _config_text(config), 0o600)
        written.append(CONFIG)
    files = hashed_by_their_writers(tmp, written, group)  # also waits for every rank's files
    if _rank(group) == 0:
        write_manifest(tmp, files)
        _remove(final)
        tmp.rename(final)
        write_atomic(directory / LATEST, final.name + "\n", 0o600)  # never through a planted link
        if keep is not None:
            for old in older_checkpoints(directory, final, keep):
                _remove(old)
    barrier(group)
    return final


def older_checkpoints(directory: Path, newest: Path, keep: int) -> list[Path]:
    """The ``step-<N>`` checkpoint directories under ``directory`` beyond the ``keep`` newest, ``newest`` (the
    one just written, which ``latest`` names) counted first whatever its number; never a link, a file, or a
    directory of another name."""
    saved = [p for p in directory.iterdir()
             if _STEP_NAME.fullmatch(p.name) and p != newest and p.is_dir() and not p.is_symlink()]
    saved.sort(key=lambda p: int(p.name.split("-")[1]), reverse=True)
    return saved[keep - 1:]


SHARED_MARK = ".shared-check-"  # + a fresh token: a name no node can have cached
MARK_WAIT_S = 2.0  # a network file system may show a new file to another node a moment later


def check_shared(directory: Path, train, group) -> None:
    """Every rank of ``group`` sees the checkpoint folder ``directory`` as rank 0 does, or a ValueError naming it,
    on every rank alike: each rank writes its shards there and rank 0 renames the save, so a folder on each
    node's own disk would leave every checkpoint incomplete, and a resume would read another one on each node.
    Only a run that saves checkpoints (``train.checkpoint_every``) or resumes from one (``train.resume``)
    checks, and one rank alone never does.

    Rank 0 writes a marker holding a fresh token (creating the folder if needed, both removed after); once it
    is written (the agreement on its errors is the barrier) every rank reads it, and one all-gather of what
    each read settles it, the same on every rank."""
    if not (train.checkpoint_every or train.resume) or group is None or dist.get_world_size(group) == 1:
        return
    main, world = dist.get_rank(group) == 0, dist.get_world_size(group)
    told = [(secrets.token_hex(16), str(directory))] if main else [None]
    dist.broadcast_object_list(told, src=dist.get_global_rank(group, 0), group=group)
    token, shown = told[0]  # shown: rank 0's path, the same line on every rank
    mark, made = Path(directory) / f"{SHARED_MARK}{token}", []

    def write():
        if main:
            try:
                if not os.path.lexists(directory):
                    Path(directory).mkdir(parents=True, mode=0o700)
                    made.append(directory)
                write_atomic(mark, token, 0o600)
            except OSError as e:
                raise ValueError(f"checkpoint folder {shown} is not writable ({e.strerror or e})") from None

    agree_on_errors(write, group)
    seen = [None] * world
    dist.all_gather_object(seen, _read_mark(mark) == token, group=group)
    if main:
        mark.unlink(missing_ok=True)
        for folder in made:
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # left as it was: a save makes it again
    blind = [rank for rank, saw in enumerate(seen) if not saw]
    if blind:
        raise not_shared(shown, blind, world)


def not_shared(folder: str, blind: list[int], world: int) -> ValueError:
    """``check_shared``'s error: the folder and the ranks that cannot see rank 0's file there."""
    names = ", ".join(map(str, blind[:4])) + (f" and {len(blind) - 4} more" if len(blind) > 4 else "")
    return ValueError(f"checkpoint folder {folder} is not shared by every node: checkpoints need a file system every "
                      f"node sees (rank{'s' if len(blind) > 1 else ''} {names} of {world} cannot see the file rank 0 "
                      "wrote there)")


def _read_mark(path: Path, wait_s: float = MARK_WAIT_S) -> str | None:
    """The marker's text, as short as rank 0 wrote it and read without following a link, or None if this rank
    cannot see it within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return read_regular(path, 64).decode(errors="replace")
        except (CheckpointError, OSError):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)


def _refuse_non_finite(state: dict, directory: Path, step: int) -> None:
    """A checkpoint never holds NaN or Inf (a resume refuses one): the save is refused instead, so
    ``latest`` keeps naming the last good checkpoint. One check on the device, one host read."""
    key = _non_finite_key(state)
    if key is None:
        return
    last = latest(directory) if directory.is_dir() else None
    kept = (f"the newest checkpoint is still {last}, from which train.resume=true continues" if last is not None
            else "no checkpoint was written")
    raise CheckpointError(f"not saving checkpoint step-{step}: {key!r} holds NaN or Inf; {kept}")


def _remove(path: Path) -> None:
    """Remove a leftover file, symlink (never its target) or directory tree at ``path``."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory``, or None. ``latest`` is a small regular file
    that may only name a ``step-<N>`` directory of this very directory (no path, no link out of it)."""
    directory = Path(directory)
    pointer = directory / LATEST
    if not pointer.exists() and not pointer.is_symlink():
        return None
    name = read_regular(pointer, 4096).decode(errors="replace").strip()
    path = directory / name
    if not _STEP_NAME.fullmatch(name) or path.resolve().parent != directory.resolve():
        raise CheckpointError(f"{pointer} names {name[:80]!r}, not a step-<N> checkpoint of {directory}")
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError(f"{pointer} names {name}, which is not a checkpoint directory here (missing, "
                              "or a symlink)")
    return path


def _config_text(config: dict) -> str:
    return json.dumps(config, indent=1, default=str) + "\n"


def as_saved(config: dict) -> dict:
    """``config`` as ``saved_config`` reads it back from a checkpoint (JSON: a tuple comes back as a list, a
    value JSON cannot hold as its text)."""
    return json.loads(_config_text(config))


def saved_config(path: str | Path) -> dict | None:
    """The run config a checkpoint was saved with, checked against its manifest (None for checkpoints
    written before it was kept)."""
    path = Path(path)
    files = manifest_files(path)
    if CONFIG not in files:
        return None
    config = read_json(path / CONFIG, checked_bytes(path, CONFIG, files, 1 << 20))
    if not isinstance(config, dict):
        raise CheckpointError(f"checkpoint {path}: {CONFIG} holds a {type(config).__name__}, not a run config")
    return config


# State a later release added, by last key part and release: a checkpoint saved before it loads it
# as zeros (BRANCH's balance_bias at zero selects as the unbalanced limit it was saved with).
ADDED_SINCE = {"balance_bias": "0.1.0"}


def load(path: str | Path, model: nn.Module, optimizer, extra: dict, group=None) -> dict:
    """Fill ``model``, ``optimizer`` (its state created by one zero step first) and the tensors
    in ``extra`` from ``path``; keys in ``extra`` missing from the checkpoint are left as they are.
    The checkpoint is verified first (``checkpoint_files``): an untrusted or damaged one raises
    ``CheckpointError`` and loads nothing; a loaded tensor that is not finite raises it too."""
    # torch.distributed.checkpoint: ~1.6 s to import, only when a checkpoint is read
    from dist_moe.train.checkpoint.dcp import load_state

    metadata, identities = verify(path)
    _materialise_optimizer_state(model, optimizer)
    state = state_of(model, optimizer, {})
    present = metadata.state_dict_metadata
    newer = {k for k in state if k not in present and k.rsplit(".", 1)[-1] in ADDED_SINCE}
    missing = sorted(k for k in state if k not in present and k not in newer)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} entries this model needs, e.g. {missing[0]!r} "
                         "(another model, or experts this checkpoint never held)")
    wanted = {k: v for k, v in extra.items() if k in present}
    loaded = {k: v for k, v in state.items() if k not in newer}
    state.update({k: torch.zeros_like(state[k]) for k in newer})  # their value before the release: zero
    for key, t in {**loaded, **wanted}.items():
        props = present[key]
        if props.properties.dtype != t.dtype or tuple(props.size) != tuple(t.shape):
            raise CheckpointError(f"checkpoint {path} does not fit this model: {key!r} is {props.properties.dtype} "
                                  f"{list(props.size)} there and {t.dtype} {list(t.shape)} here (another model size, "
                                  "router or expert count than the run that saved it)")
    try:
        load_state({**loaded, **wanted}, Path(path), metadata, identities, group)
    except (RuntimeError, AssertionError) as e:  # DCP's own size checks
        raise CheckpointError(f"checkpoint {path} does not fit this model ({first_line(e)[:300]})") from None
    _check_values(path, {**loaded, **wanted})
    _write_back(model, optimizer, state)
    return wanted


def _non_finite_key(state: dict) -> str | None:
    """The first key whose floating tensor holds NaN or Inf, or None: one stacked check on the device
    and one host read when all are finite (the usual case), a read per tensor only to name the culprit."""
    floats = [(k, t) for k, t in state.items() if t.is_floating_point()]
    if not floats or bool(torch.stack([torch.isfinite(t).all() for _, t in floats]).all()):
        return None
    return next(k for k, t in floats if not bool(torch.isfinite(t).all()))


def _check_values(path, state: dict) -> None:
    """Training never saves a NaN or Inf (such steps are skipped, and a save refuses them) nor a negative
    count (steps, EMA steps): a loaded tensor holding one comes from a damaged or forged file."""
    key = _non_finite_key(state)
    if key is not None:
        raise CheckpointError(f"checkpoint {path}: {key!r} holds NaN or Inf")
    for key, t in state.items():
        if not t.is_floating_point() and t.dtype not in (torch.bool, torch.uint8) and bool((t < 0).any()):
            raise CheckpointError(f"checkpoint {path}: {key!r} holds a negative count ({int(t.min())})")


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
            model_state[key] = t if t is None else state[f"model.{key}"]
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
