"""A crafted checkpoint, with a manifest rewritten to match, runs nothing and reads nothing
outside its directory: bytes entries (DCP would unpickle them), storage paths that leave the
step, files that are not regular, forged counts. Each attack is first shown to work on stock DCP."""
import hashlib
import json
import os
import pickle
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from dist_moe import MoELayer
from dist_moe.train.checkpoint import state as training_state
from dist_moe.train.checkpoint import store as checkpoint
from tests.support.file_audit import opened_files

SHARD = "__0_0.distcp"


class _Payload:  # runs a command when unpickled
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _saved(tmp_path):
    model = MoELayer(8, 16, {"type": "switch", "num_experts": 4, "top_k": 2})
    opt = torch.optim.Adam(model.parameters())
    path = checkpoint.save(tmp_path / "ckpt", 1, model, opt, {"step": torch.tensor(1)})
    return path, model, opt


def _reseal(path: Path) -> None:
    """Rewrite the manifest to match whatever the directory now holds, as an attacker would."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in path.iterdir() if p.is_file() and not p.is_symlink() and p.name != checkpoint.MANIFEST}
    (path / checkpoint.MANIFEST).write_text(json.dumps({"format": 1, "files": files}))


def _forge(path: Path, entry, relative_path: str, offset: int, length: int) -> None:
    """Point the state-dict entry ``step`` at (relative_path, offset, length), declared as ``entry``."""
    md = pickle.loads((path / ".metadata").read_bytes())
    index = MetadataIndex("step") if entry is not None else next(k for k in md.storage_data if k.fqn == "step")
    if entry is not None:
        md.state_dict_metadata["step"] = entry
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "step"}
    md.storage_data[index] = _StorageInfo(relative_path, offset, length)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    _reseal(path)


def _bytes_attack(path: Path, outside: Path, where: str, marker: Path) -> None:
    payload = pickle.dumps(_Payload(marker))
    if where == "a new file":
        (path / "extra.distcp").write_bytes(payload)
        _forge(path, BytesStorageMetadata(), "extra.distcp", 0, len(payload))
    elif where == "appended to a listed shard":
        offset = (path / SHARD).stat().st_size
        with (path / SHARD).open("ab") as f:
            f.write(payload)
        _forge(path, BytesStorageMetadata(), SHARD, offset, len(payload))
    else:  # an absolute path outside the checkpoint
        (outside / "evil.bin").write_bytes(payload)
        _forge(path, BytesStorageMetadata(), str(outside / "evil.bin"), 0, len(payload))


def _tensor_attack(path: Path, outside: Path, where: str) -> None:
    """``step`` read as a tensor (777) from a file outside the checkpoint."""
    raw = _tensor_bytes(torch.tensor(777))
    (outside / "step.distcp").write_bytes(raw)
    if where == "absolute":
        name = str(outside / "step.distcp")
    elif where == "../-relative":
        name = os.path.relpath(outside / "step.distcp", path)
    else:  # behind a symlinked directory inside the step
        (path / "sub").symlink_to(outside, target_is_directory=True)
        name = "sub/step.distcp"
    _forge(path, None, name, 0, len(raw))


def _tensor_bytes(t: torch.Tensor) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


BYTES = ["a new file", "appended to a listed shard", "an absolute path outside"]
TENSOR = ["absolute", "../-relative", "behind a symlinked directory"]


@pytest.fixture
def outside(tmp_path):
    d = tmp_path / "outside"
    d.mkdir()
    return d


@pytest.mark.parametrize("where", BYTES)
def test_the_bytes_attacks_run_code_through_stock_dcp(tmp_path, outside, where):
    path, model, _ = _saved(tmp_path)
    marker = tmp_path / "pwned"
    _bytes_attack(path, outside, where, marker)
    with pytest.raises(BaseException):  # noqa: B017  DCP's CheckpointException: the payload is no tensor, but it ran
        dcp.load({"step": torch.tensor(0)}, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    assert marker.exists()


@pytest.mark.parametrize("where", TENSOR)
def test_the_path_attacks_read_outside_through_stock_dcp(tmp_path, outside, where):
    path, _, _ = _saved(tmp_path)
    _tensor_attack(path, outside, where)
    step = {"step": torch.tensor(0)}
    dcp.load(step, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    assert int(step["step"]) == 777


def _refused(path, model, opt, outside, match):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = torch.tensor(0)
    with opened_files() as opened, pytest.raises(checkpoint.CheckpointError, match=match):
        checkpoint.load(path, model, opt, {"step": step})
    assert not [p for p in opened if p.startswith(str(outside))], opened
    assert int(step) == 0 and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("where", BYTES)
def test_a_bytes_entry_is_refused_and_nothing_runs(tmp_path, outside, where):
    path, model, opt = _saved(tmp_path)
    marker = tmp_path / "pwned"
    _bytes_attack(path, outside, where, marker)
    _refused(path, model, opt, outside, "declares 'step' as BytesStorageMetadata")
    assert not marker.exists()


@pytest.mark.parametrize("where", TENSOR)
def test_storage_outside_the_step_is_refused_and_never_read(tmp_path, outside, where):
    path, model, opt = _saved(tmp_path)
    _tensor_attack(path, outside, where)
    match = "holds 'sub', a symlink" if where.startswith("behind") else "not a shard of this checkpoint's manifest"
    _refused(path, model, opt, outside, match)


def test_megatrons_old_extra_state_entries_are_tolerated_and_never_read(tmp_path):
    """Checkpoints of Megatron-hosted runs saved before bytes entries were refused carry ``._extra_state``
    bytes entries (None): they still resume, and those entries are never read (nothing requests them)."""
    path, model, opt = _saved(tmp_path)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    md = pickle.loads((path / ".metadata").read_bytes())
    md.state_dict_metadata["model.experts.local.0._extra_state"] = BytesStorageMetadata()
    offset = (path / SHARD).stat().st_size
    with (path / SHARD).open("ab") as f:
        f.write(payload)
    md.storage_data[MetadataIndex("model.experts.local.0._extra_state")] = _StorageInfo(SHARD, offset, len(payload))
    (path / ".metadata").write_bytes(pickle.dumps(md))
    _reseal(path)
    checkpoint.load(path, model, opt, {})
    assert not marker.exists()


def test_a_symlinked_path_in_the_metadata_alone_is_refused(tmp_path, outside):
    """The metadata's own check, without the directory listing's: a path into a subdirectory."""
    path, model, opt = _saved(tmp_path)
    _forge(path, None, f"sub/{SHARD}", 0, 10)
    _refused(path, model, opt, outside, "not a shard of this checkpoint's manifest")


def test_a_shard_replaced_after_verification_is_not_read(tmp_path, monkeypatch):
    """What DCP reads is the very file that was hashed: swapped in between, it is refused."""
    path, model, opt = _saved(tmp_path)
    real_verify = checkpoint.verify

    def verify_then_swap(p):
        out = real_verify(p)
        data = (path / SHARD).read_bytes()
        (path / SHARD).unlink()
        (path / SHARD).write_bytes(data)  # same bytes, another file
        return out

    monkeypatch.setattr(checkpoint, "verify", verify_then_swap)
    with pytest.raises(checkpoint.CheckpointError, match=f"{SHARD} changed after it was verified"):
        checkpoint.load(path, model, opt, {})


def test_metadata_is_read_once_and_only_listed_files_are_opened(tmp_path):
    """The bytes that are hashed are the bytes that are unpickled: .metadata is opened once per load."""
    path, model, opt = _saved(tmp_path)
    with opened_files() as opened:
        checkpoint.load(path, model, opt, {"step": torch.tensor(0)})
    mine = [p for p in opened if p.startswith(str(tmp_path))]
    assert [p for p in mine if p.endswith("/.metadata")] == [str(path / ".metadata")]
    listed = set(json.loads((path / checkpoint.MANIFEST).read_text())["files"]) | {checkpoint.MANIFEST}
    assert {Path(p).parent for p in mine} == {path} and {Path(p).name for p in mine} <= listed


@pytest.mark.parametrize("target", ["/dev/zero", "fifo"])
def test_latest_naming_a_device_or_fifo_is_refused_at_once(tmp_path, target):
    path, _, _ = _saved(tmp_path)
    pointer = path.parent / checkpoint.LATEST
    pointer.unlink()
    if target == "fifo":
        os.mkfifo(pointer)
    else:
        pointer.symlink_to(target)
    signal.alarm(20)  # a read that blocks fails the test instead of hanging the suite
    try:
        with pytest.raises(checkpoint.CheckpointError, match="latest is (a symlink|not a regular file)"):
            checkpoint.latest(path.parent)
    finally:
        signal.alarm(0)


@pytest.mark.parametrize("name", [".metadata", SHARD, checkpoint.MANIFEST, checkpoint.CONFIG])
def test_a_checkpoint_file_that_is_a_fifo_or_device_is_refused_at_once(tmp_path, name):
    model = MoELayer(8, 16, {"type": "switch", "num_experts": 4, "top_k": 2})
    opt = torch.optim.Adam(model.parameters())
    path = checkpoint.save(tmp_path / "ckpt", 1, model, opt, {}, config={"seed": 0})
    (path / name).unlink()
    os.mkfifo(path / name)
    signal.alarm(20)
    try:
        with pytest.raises(checkpoint.CheckpointError, match="not a regular file"):
            checkpoint.saved_config(path) if name == checkpoint.CONFIG else checkpoint.load(path, model, opt, {})
    finally:
        signal.alarm(0)


@pytest.mark.parametrize("manifest, match", [
    ([1, 2], "not a mapping with a 'files' mapping"),
    ({"files": [".metadata"]}, "not a mapping with a 'files' mapping"),
    ({"files": {".metadata": {"bytes": "12", "sha256": "x"}}}, "entry for '.metadata' is not"),
    ({"files": {"../../config.yaml": {"bytes": 1, "sha256": "x"}}}, "names '../../config.yaml', not a file"),
    ("[" * 100000 + "]" * 100000, "not readable JSON .nested deeper than 32 levels"),
])
def test_a_manifest_of_the_wrong_shape_is_refused(tmp_path, manifest, match):
    path, model, opt = _saved(tmp_path)
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    (path / checkpoint.MANIFEST).write_text(text)
    with pytest.raises(checkpoint.CheckpointError, match=match):
        checkpoint.load(path, model, opt, {})


def test_a_saved_config_that_is_not_a_mapping_is_refused(tmp_path):
    model = MoELayer(8, 16, {"type": "switch", "num_experts": 4, "top_k": 2})
    path = checkpoint.save(tmp_path / "ckpt", 1, model, torch.optim.Adam(model.parameters()), {}, config={"seed": 0})
    (path / checkpoint.CONFIG).write_text("[1, 2]")
    _reseal(path)
    with pytest.raises(checkpoint.CheckpointError, match="config.json holds a list, not a run config"):
        checkpoint.saved_config(path)
    (path / checkpoint.CONFIG).write_text('[3, 4]')  # edited, manifest not: refused as corrupted
    with pytest.raises(checkpoint.CheckpointError, match="config.json fails its SHA-256 check"):
        checkpoint.saved_config(path)


class _Runtime:
    world, rank, group, device = 1, 0, None, torch.device("cpu")


@pytest.mark.parametrize("key, value", [("data.samples", -10**15), ("step", -3), ("step", 2**62)])
def test_a_forged_position_is_refused(tmp_path, key, value):
    model = MoELayer(8, 16, {"type": "switch", "num_experts": 4, "top_k": 2})
    opt = torch.optim.Adam(model.parameters())
    cursor = training_state.DataCursor(100, 0, 10)
    position = training_state.position(1, cursor, _Runtime())
    position[key] = torch.tensor(value)
    path = checkpoint.save(tmp_path / "ckpt", 1, model, opt, position)
    with pytest.raises(checkpoint.CheckpointError, match=f"{key!r} holds a negative count|{key} is {value}, not a"):
        training_state.restore_state(path, model, opt, training_state.DataCursor(100, 0, 10), _Runtime())


def test_a_non_finite_or_negative_model_tensor_is_refused(tmp_path, monkeypatch):
    model = MoELayer(8, 16, {"type": "branch", "num_experts": 4, "top_k": 2})
    opt = torch.optim.Adam(model.parameters())
    with torch.no_grad():
        model.router.anchors[1] = float("inf")
    with monkeypatch.context() as m:  # dist-moe never saves an Inf (test_checkpoint.py): a forged file does
        m.setattr(checkpoint, "_refuse_non_finite", lambda *a: None)
        path = checkpoint.save(tmp_path / "a", 1, model, opt, {})
    with pytest.raises(checkpoint.CheckpointError, match="'model.router.anchors' holds NaN or Inf"):
        checkpoint.load(path, model, opt, {})
    fresh = MoELayer(8, 16, {"type": "branch", "num_experts": 4, "top_k": 2})
    fresh.router.ema_step.fill_(-5)
    path = checkpoint.save(tmp_path / "b", 1, fresh, torch.optim.Adam(fresh.parameters()), {})
    with pytest.raises(checkpoint.CheckpointError, match="'model.router.ema_step' holds a negative count"):
        checkpoint.load(path, fresh, torch.optim.Adam(fresh.parameters()), {})


def test_a_planted_pointer_symlink_is_replaced_not_written_through(tmp_path):
    """A save never writes through a symlink planted at its pointer (or the old fixed temporary name)."""
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    model = MoELayer(8, 16, {"type": "switch", "num_experts": 4, "top_k": 2})
    opt = torch.optim.Adam(model.parameters())
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".latest.tmp").symlink_to(victim)
    (tmp_path / "ckpt" / "latest").symlink_to(victim)
    checkpoint.save(tmp_path / "ckpt", 1, model, opt, {})
    assert victim.read_text() == "keep me\n"
    assert checkpoint.latest(tmp_path / "ckpt").name == "step-1"
