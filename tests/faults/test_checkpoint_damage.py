"""A corrupted, truncated, incomplete or padded checkpoint is refused with a clear error, and
nothing of it is loaded."""
import pytest
import torch

from dist_moe import MoELayer
from dist_moe.train.checkpoint import store as checkpoint


def _saved(tmp_path):
    torch.manual_seed(0)
    model = MoELayer(8, 16, {"type": "branch", "num_experts": 4, "top_k": 2})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    y, aux = model(torch.randn(32, 8))
    (y.square().mean() + aux).backward()
    opt.step()
    path = checkpoint.save(tmp_path / "ckpt", 1, model, opt, {"position": torch.tensor([1])})
    return path


def _fresh():
    torch.manual_seed(1)
    model = MoELayer(8, 16, {"type": "branch", "num_experts": 4, "top_k": 2})
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _data_file(path):
    return next(p for p in path.iterdir() if p.suffix == ".distcp")


def _flip_byte(path):
    f = _data_file(path)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))


def _truncate(path):
    f = _data_file(path)
    f.write_bytes(f.read_bytes()[:-7])


@pytest.mark.parametrize("damage, message", [
    (_flip_byte, "SHA-256"),
    (_truncate, "bytes, the manifest says"),
    (lambda p: (p / checkpoint.MANIFEST).unlink(), "no manifest.json"),
    (lambda p: (p / "stray.distcp").write_bytes(b"x"), "does not list"),
    (lambda p: (p / ".metadata").unlink(), "missing .metadata"),
])
def test_damage_is_detected_and_nothing_loads(tmp_path, damage, message):
    path = _saved(tmp_path)
    checkpoint.verify(path)  # intact first
    damage(path)
    model, opt = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    extra = {"position": torch.tensor([0])}
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.load(path, model, opt, extra)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no partial load
    assert int(extra["position"]) == 0


def test_state_files_are_private(tmp_path):
    path = _saved(tmp_path)
    assert (path.stat().st_mode & 0o777) == 0o700
    for f in path.iterdir():
        assert (f.stat().st_mode & 0o777) == 0o600, f
    assert ((tmp_path / "ckpt" / checkpoint.LATEST).stat().st_mode & 0o777) == 0o600
