"""Loading never runs pickled code, YAML is read safely, no shell is built from config strings,
and state files are written atomically and privately."""
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from dist_moe import MoELayer
from dist_moe.train.checkpoint import store as checkpoint
from dist_moe.train.config import load_config
from tests.support.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("dist_moe", "placement", "experiments", "benchmarks") for p in (ROOT / d).rglob("*.py")]


class _Payload:  # a pickle that runs a command when loaded
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _text(s: str) -> bytes:  # BINUNICODE
    return b"X" + len(s.encode()).to_bytes(4, "little") + s.encode()


def _global(module: str, name: str, proto4: bool = True) -> bytes:
    if proto4:  # SHORT_BINUNICODE x2, STACK_GLOBAL: the form that resolves dotted names
        return b"\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)]) + name.encode() + b"\x93"
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _call(module: str, name: str, arg: str, proto4: bool = True) -> bytes:
    return _global(module, name, proto4) + _text(arg) + b"\x85R"  # TUPLE1, REDUCE


def _saved(tmp_path):
    model = MoELayer(8, 16, {"type": "switch", "num_experts": 4, "top_k": 2})
    opt = torch.optim.Adam(model.parameters())
    return checkpoint.save(tmp_path / "ckpt", 1, model, opt, {}), model, opt


def _plant(path: Path, raw: bytes, also=()) -> None:
    """Replace .metadata and fix the manifest (for it and the files ``also``), as an attacker with write
    access would."""
    (path / ".metadata").write_bytes(raw)
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    for name in (".metadata", *also):
        data = (path / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))


def _payloads(marker: Path, real: bytes) -> dict:
    cmd = f"touch {marker}"
    body = pickle.dumps(pickle.loads(real), protocol=2)[2:]  # the real metadata, without its PROTO
    return {
        "posix.system": (pickle.dumps(_Payload(marker)), "posix.system"),
        # resolves through the allowed module's namespace (it imports os) to os.system
        "dotted name in an allowed module": (b"\x80\x04" + _call("torch.distributed.checkpoint.metadata", "os.system",
                                                                 cmd) + b".",
                                             "torch.distributed.checkpoint.metadata.os.system"),
        # the command first, then the genuine metadata, so a permissive load succeeds silently
        "payload before the real metadata": (b"\x80\x02" + _call("posix", "system", cmd, False) + b"0" + body,
                                             "posix.system"),
        "builtins.eval": (b"\x80\x02" + _call("builtins", "eval", f"__import__('os').system({cmd!r})", False) + b".",
                          "builtins.eval"),
        "getattr chain": (b"\x80\x02" + _global("builtins", "getattr", False) + b"(" +
                          _call("builtins", "__import__", "os", False) + _text("system") + b"tR" + _text(cmd) +
                          b"\x85R.", "builtins.getattr"),
    }


def test_the_planted_payloads_would_run_without_the_allow_list(tmp_path):
    """The attacks are real: a permissive unpickler resolves each to a callable that runs commands
    (recorded here instead of called), and the one that hides in front of the metadata returns it."""
    path, _, _ = _saved(tmp_path)
    real = (path / ".metadata").read_bytes()
    calls = []

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            target = super().find_class(module, name)
            if target in (os.system, eval, getattr, __import__):
                return harmless
            return target

    def harmless(*args):  # records the call and stands in for whatever it would have returned
        calls.append(args)
        return harmless

    for what, (raw, _) in _payloads(tmp_path / "x", real).items():
        calls.clear()
        out = Recording(io.BytesIO(raw)).load()
        assert calls, what
        if what == "payload before the real metadata":
            assert type(out).__name__ == "Metadata"


@pytest.mark.parametrize("what", ["posix.system", "dotted name in an allowed module",
                                  "payload before the real metadata", "builtins.eval", "getattr chain"])
def test_a_planted_metadata_pickle_is_refused_not_run(tmp_path, what):
    path, model, opt = _saved(tmp_path)
    marker = tmp_path / "pwned"
    raw, named = _payloads(marker, (path / ".metadata").read_bytes())[what]
    _plant(path, raw)
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(f"refusing to unpickle {named}")):
        checkpoint.load(path, model, opt, {})
    assert not marker.exists()


def test_a_planted_checkpoint_stops_a_resumed_training_run(tmp_path):
    """Through the CLI, as the attack was reported: exit 2 naming the global, and the command never runs."""
    out = tmp_path / "run"
    args = [str(ROOT / ".venv/bin/dist-moe"), "train", "--quiet", "data.max_rows=300", "train.max_steps=4",
            "train.checkpoint_every=2", f"output.dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env).returncode == 0
    marker = tmp_path / "pwned"
    latest = checkpoint.latest(out / "checkpoints")
    genuine = tmp_path / "genuine"
    shutil.copytree(latest, genuine)
    _plant(latest, b"\x80\x04" + _call("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}") + b".")
    resume = args + ["train.resume=true", "train.max_steps=6"]
    r = subprocess.run(resume, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "refusing to unpickle torch.distributed.checkpoint.metadata.os.system" in r.stderr
    assert "Traceback" not in r.stderr
    assert not marker.exists()
    # the genuine metadata, but `step` declared as a bytes entry holding a pickle (DCP would run it)
    shutil.rmtree(latest)
    shutil.copytree(genuine, latest)
    payload = pickle.dumps(_Payload(marker))
    (latest / "extra.distcp").write_bytes(payload)
    md = pickle.loads((latest / ".metadata").read_bytes())
    md.state_dict_metadata["step"] = BytesStorageMetadata()
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "step"}
    md.storage_data[MetadataIndex("step")] = _StorageInfo("extra.distcp", 0, len(payload))
    _plant(latest, pickle.dumps(md), also=["extra.distcp"])
    r = subprocess.run(resume, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "declares 'step' as BytesStorageMetadata" in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists()


def test_yaml_tags_that_build_objects_are_rejected(tmp_path):
    bad = tmp_path / "bad.yaml"
    marker = tmp_path / "pwned"
    bad.write_text(f'name: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(bad)
    assert not marker.exists()


def test_sources_avoid_unsafe_loaders_and_shells():
    patterns = {r"\bpickle\.loads?\(": "pickle.load",
                r"yaml\.load\((?![^)]*Loader=_Loader)": "yaml.load without a safe loader",
                r"yaml\.unsafe_load|yaml\.full_load": "unsafe yaml", r"shell\s*=\s*True": "shell=True",
                r"os\.system\(|os\.popen\(": "os.system/popen", r"(?<![.\w])eval\(|(?<![.\w])exec\(": "eval/exec",
                r"allow_pickle\s*=\s*True": "np.load(allow_pickle=True)",
                r"torch\.load\((?![^)]*weights_only=True)": "torch.load without weights_only=True"}
    found = []
    for path in SOURCES:
        text = path.read_text()
        for pattern, what in patterns.items():
            for m in re.finditer(pattern, text):
                if path.name == "checkpoint_files.py" and what == "pickle.load":
                    continue
                found.append(f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {what}")
    assert not found, found


def test_config_strings_never_reach_a_shell(tmp_path):
    """An override full of shell syntax goes through the launcher to the trainer as one literal
    argument: it is refused as a bad value, and nothing it names runs."""
    marker = tmp_path / "pwned"
    value = f"x$(touch {marker});touch {marker}`touch {marker}`"
    r = subprocess.run(["bash", str(ROOT / "launch/torchrun.sh"), "--nproc", "1", "--port", str(free_port()),
                        f"data.name={value}"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode != 0
    assert "data.name must be one of" in r.stdout + r.stderr
    assert not marker.exists()
