"""Loading never runs pickled code, YAML is read safely, no shell is built from config strings,
and state files are written atomically and privately."""
import hashlib
import json
import os
import pickle
import re
import subprocess
from pathlib import Path

import pytest
import torch

from dist_moe import MoELayer
from dist_moe.train import checkpoint
from dist_moe.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("dist_moe", "placement", "experiments", "benchmarks") for p in (ROOT / d).rglob("*.py")]


class _Payload:  # a pickle that runs a command when loaded
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_metadata_pickle_is_refused_not_run(tmp_path):
    model = MoELayer(8, 16, {"type": "switch", "num_experts": 4, "top_k": 2})
    opt = torch.optim.Adam(model.parameters())
    path = checkpoint.save(tmp_path / "ckpt", 1, model, opt, {})
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())  # the attacker fixes the manifest too
    raw = (path / ".metadata").read_bytes()
    manifest["files"][".metadata"] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match="refusing to unpickle posix.system"):
        checkpoint.load(path, model, opt, {})
    assert not marker.exists()


def test_yaml_tags_that_build_objects_are_rejected(tmp_path):
    bad = tmp_path / "bad.yaml"
    marker = tmp_path / "pwned"
    bad.write_text(f'name: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(bad)
    assert not marker.exists()


def test_sources_avoid_unsafe_loaders_and_shells():
    patterns = {r"\bpickle\.loads?\(": "pickle.load", r"yaml\.load\((?![^)]*Loader=_Loader)": "yaml.load without a safe loader",
                r"yaml\.unsafe_load|yaml\.full_load": "unsafe yaml", r"shell\s*=\s*True": "shell=True",
                r"os\.system\(|os\.popen\(": "os.system/popen", r"(?<![.\w])eval\(|(?<![.\w])exec\(": "eval/exec",
                r"allow_pickle\s*=\s*True": "np.load(allow_pickle=True)",
                r"torch\.load\((?![^)]*weights_only=True)": "torch.load without weights_only=True"}
    found = []
    for path in SOURCES:
        text = path.read_text()
        for pattern, what in patterns.items():
            for m in re.finditer(pattern, text):
                if path.name == "checkpoint.py" and what == "pickle.load":
                    continue
                found.append(f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {what}")
    assert not found, found


def test_config_strings_never_reach_a_shell(tmp_path):
    """An override full of shell syntax goes through the launcher to the trainer as one literal
    argument: it is refused as a bad value, and nothing it names runs."""
    marker = tmp_path / "pwned"
    value = f"x$(touch {marker});touch {marker}`touch {marker}`"
    r = subprocess.run(["bash", str(ROOT / "launch/torchrun.sh"), "--nproc", "1", "--port", "29877",
                        f"data.name={value}"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode != 0
    assert "data.name must be one of" in r.stdout + r.stderr
    assert not marker.exists()
