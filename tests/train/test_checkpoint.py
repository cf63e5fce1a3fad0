"""DCP checkpoints: atomic saves, exact restore, and resharding across expert-parallel sizes."""
import pytest
import torch

from dist_moe import MoELayer
from dist_moe.train.checkpoint import store as checkpoint
from placement import Placement
from tests.support.dist_utils import run_workers

H, F, E = 6, 8, 8
ROUTER = {"type": "branch", "num_experts": E, "top_k": 2}


def _inputs():
    g = torch.Generator().manual_seed(5)
    return torch.randn(40, H, generator=g), torch.randn(40, H, generator=g)


def _step(layer, opt, x, w, group=None):
    from dist_moe.moe.view import moe_views
    from dist_moe.train.step.gar_step import rank_local_param_ids
    from dist_moe.train.step.grads import sum_replicated_grads

    y, aux = layer(x)
    opt.zero_grad()
    ((y * w).sum() + aux).backward()
    if group is not None:  # data-parallel sum: the router stays the same on every rank
        sum_replicated_grads(list(layer.parameters()), rank_local_param_ids(moe_views(layer)), group)
    opt.step()


def _shard(t, rank, world):
    return torch.tensor_split(t, world)[rank]


def _save_worker(rank, world, directory):
    import torch.distributed as dist

    torch.manual_seed(0)
    layer = MoELayer(H, F, dict(ROUTER), placement=Placement.round_robin(E, world), group=dist.group.WORLD)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x, w = _inputs()
    for _ in range(2):
        _step(layer, opt, _shard(x, rank, world), _shard(w, rank, world), dist.group.WORLD)
    checkpoint.save(directory, 2, layer, opt, {"step": torch.tensor(2)}, group=dist.group.WORLD)
    layer.eval()
    y, _ = layer(_shard(x, rank, world))
    parts = [torch.empty(len(_shard(x, r, world)), H) for r in range(world)]
    dist.all_gather(parts, y.detach().contiguous())
    if rank == 0:
        torch.save({"y": torch.cat(parts), "anchors": layer.router.anchors.clone()}, f"{directory}/reference.pt")


def _load_worker(rank, world, directory, placement):
    import torch.distributed as dist

    torch.manual_seed(123)  # different initial weights: everything must come from the checkpoint
    layer = MoELayer(H, F, dict(ROUTER), placement=placement, group=dist.group.WORLD)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    extra = checkpoint.load(checkpoint.latest(directory), layer, opt, {"step": torch.tensor(0)},
                            group=dist.group.WORLD)
    assert int(extra["step"]) == 2
    layer.eval()
    x, _ = _inputs()
    y, _ = layer(_shard(x, rank, world))
    ref = torch.load(f"{directory}/reference.pt")
    assert torch.allclose(y, _shard(ref["y"], rank, world), atol=1e-6)
    assert torch.equal(layer.router.anchors, ref["anchors"])
    assert int(layer.router.ema_step) == 2


def test_checkpoint_saved_at_ep4_loads_at_ep2_and_ep1_with_other_placements(tmp_path):
    directory = str(tmp_path / "ckpt")
    run_workers(_save_worker, 4, args=(directory,), timeout=120)
    assert checkpoint.latest(directory).name == "step-2"
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))
    run_workers(_load_worker, 2, args=(directory, Placement.contiguous(E, 2)), timeout=120)
    # one process holding every expert
    torch.manual_seed(7)
    layer = MoELayer(H, F, dict(ROUTER))
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    checkpoint.load(checkpoint.latest(directory), layer, opt, {})
    layer.eval()
    x, w = _inputs()
    ref = torch.load(f"{directory}/reference.pt")
    assert torch.allclose(layer(x)[0], ref["y"], atol=1e-6)
    # optimizer state came along, keyed by global expert id: one more step matches a fresh
    # process that loads the same checkpoint and takes the same step
    twin = MoELayer(H, F, dict(ROUTER))
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
    checkpoint.load(checkpoint.latest(directory), twin, twin_opt, {})
    assert torch.equal(opt.state[layer.experts.w_gate]["exp_avg"], twin_opt.state[twin.experts.w_gate]["exp_avg"])
    assert float(opt.state[layer.experts.w_gate]["exp_avg"].abs().sum()) > 0
    assert int(opt.state[layer.experts.w_gate]["step"]) == 2


def test_missing_experts_are_a_clear_error(tmp_path):
    torch.manual_seed(0)
    small = MoELayer(H, F, {"type": "switch", "num_experts": 4, "top_k": 2})
    opt = torch.optim.Adam(small.parameters())
    checkpoint.save(tmp_path, 1, small, opt, {})
    big = MoELayer(H, F, {"type": "switch", "num_experts": 8, "top_k": 2})

    with pytest.raises(ValueError, match="lacks"):
        checkpoint.load(checkpoint.latest(tmp_path), big, torch.optim.Adam(big.parameters()), {})


@pytest.mark.parametrize("where", ["expert weight", "adam state"])
def test_a_non_finite_state_is_never_saved_and_latest_keeps_the_last_good_one(tmp_path, where):
    torch.manual_seed(0)
    layer = MoELayer(H, F, {"type": "switch", "num_experts": 4, "top_k": 2})
    opt = torch.optim.Adam(layer.parameters())
    checkpoint.save(tmp_path, 1, layer, opt, {})
    weight = next(p for n, p in layer.named_parameters() if "expert" in n)
    with torch.no_grad():
        (weight if where == "expert weight" else opt.state[weight]["exp_avg_sq"])[0, 0] = float("inf")
    with pytest.raises(checkpoint.CheckpointError, match=r"not saving checkpoint step-2: .* holds NaN or Inf; "
                                                         r"the newest checkpoint is still .*step-1"):
        checkpoint.save(tmp_path, 2, layer, opt, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]  # nothing written, not even a tmp
    assert checkpoint.latest(tmp_path).name == "step-1"


def test_retention_keeps_the_one_just_written_and_the_newest_others_and_nothing_else_goes(tmp_path):
    from dist_moe.train.config import load_config

    for name in ("step-1", "step-3", "step-10", "step-2", "notes", "elsewhere"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-7").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "step-8").write_text("not a checkpoint")
    # step-2 just written (a run resumed from it saves below step-10's number): it stays, with the newest other
    old = checkpoint.older_checkpoints(tmp_path, tmp_path / "step-2", 2)
    assert sorted(p.name for p in old) == ["step-1", "step-3"]
    assert checkpoint.older_checkpoints(tmp_path, tmp_path / "step-2", 1)[0].name == "step-10"
    with pytest.raises(ValueError, match=r"^config key 'train.keep_checkpoints' must be a positive int or null, "
                                         r"got 0$"):
        load_config(None, ["train.keep_checkpoints=0"])


def test_the_balance_bias_travels_and_a_checkpoint_from_before_it_loads(tmp_path):
    limited = {"type": "branch", "num_experts": E, "top_k": 2, "subtree_limit": 1, "subtree_depth": 1}
    torch.manual_seed(0)
    layer = MoELayer(H, F, dict(limited))
    opt = torch.optim.Adam(layer.parameters())
    x, w = _inputs()
    for _ in range(3):
        _step(layer, opt, x * 3, w)
    assert layer.router.balance_bias.abs().sum() > 0
    checkpoint.save(tmp_path / "now", 3, layer, opt, {})
    twin = MoELayer(H, F, dict(limited))
    checkpoint.load(checkpoint.latest(tmp_path / "now"), twin, torch.optim.Adam(twin.parameters()), {})
    assert torch.equal(twin.router.balance_bias, layer.router.balance_bias)  # exact
    # a run saved before the balance existed (its router had no such buffer) resumes with it at zero
    old = MoELayer(H, F, {**limited, "subtree_balance": "none"})
    checkpoint.save(tmp_path / "old", 1, old, torch.optim.Adam(old.parameters()), {})
    checkpoint.load(checkpoint.latest(tmp_path / "old"), twin, torch.optim.Adam(twin.parameters()), {})
    assert not twin.router.balance_bias.any()
    assert torch.equal(twin.router.node_map.weight, old.router.node_map.weight)


RUN = ["data.max_rows=1500", "train.batch_size=64", "train.log_every=1", "router.type=switch",
       "router.jitter_eps=0.01"]  # jitter draws from the RNG: its state must come back too


def _curve(run_dir) -> dict:
    import json

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def _run(overrides):
    from dist_moe.train.config import load_config
    from dist_moe.train.trainer import train

    return train(load_config(None, overrides), quiet=True)


def test_resume_gives_the_uninterrupted_loss_curve(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path / "data"))
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _run([*RUN, f"output.dir={whole}", "train.max_steps=45"])
    # 19 training batches per epoch: the interruption falls mid-epoch, the resume crosses an epoch
    kept = ["train.checkpoint_every=5", "train.keep_checkpoints=2"]  # the older ones removed as it goes
    _run([*RUN, f"output.dir={parts}", "train.max_steps=30", *kept])
    assert checkpoint.latest(parts / "checkpoints").name == "step-30"
    assert sorted(p.name for p in (parts / "checkpoints").iterdir()) == ["latest", "step-25", "step-30"]
    _run([*RUN, f"output.dir={parts}", "train.max_steps=45", "train.resume=true", *kept])
    assert sorted(p.name for p in (parts / "checkpoints").iterdir()) == ["latest", "step-40", "step-45"]
    a, b = _curve(whole), _curve(parts)
    assert sorted(b) == list(range(1, 46))
    assert all(a[s] == b[s] for s in range(1, 46)), [(s, a[s], b[s]) for s in range(31, 46) if a[s] != b[s]][:3]


def _resume_worker(rank, world, out, data):
    import os

    os.environ["DIST_MOE_DATA"] = data
    _run([*RUN, f"output.dir={out}/whole", "train.max_steps=24"])
    _run([*RUN, f"output.dir={out}/parts", "train.max_steps=10", "train.checkpoint_every=10"])
    _run([*RUN, f"output.dir={out}/parts", "train.max_steps=24", "train.resume=true"])


def test_two_rank_resume_gives_the_uninterrupted_loss_curve(tmp_path):
    run_workers(_resume_worker, 2, args=(str(tmp_path), str(tmp_path / "data")), timeout=240)
    a, b = _curve(tmp_path / "whole"), _curve(tmp_path / "parts")
    assert sorted(b) == list(range(1, 25)) and all(a[s] == b[s] for s in range(1, 25))


def _engine_resume_worker(rank, world, engine, out, data):
    import os

    os.environ["DIST_MOE_DATA"] = data
    os.environ.setdefault("LOCAL_RANK", str(rank))  # what a launcher sets; deepspeed.initialize checks it
    extra = [f"engine={engine}", "model.capacity_factor=null", "router.jitter_eps=0.0"]
    _run([*RUN, *extra, f"output.dir={out}/whole", "train.max_steps=16"])
    _run([*RUN, *extra, f"output.dir={out}/parts", "train.max_steps=8", "train.checkpoint_every=8"])
    _run([*RUN, *extra, f"output.dir={out}/parts", "train.max_steps=16", "train.resume=true"])


@pytest.mark.parametrize("engine", ["deepspeed", "megatron"])
def test_engine_hosted_runs_resume_to_the_same_curve(tmp_path, engine):
    pytest.importorskip({"deepspeed": "deepspeed", "megatron": "megatron.core"}[engine])
    run_workers(_engine_resume_worker, 2, args=(engine, str(tmp_path), str(tmp_path / "data")), timeout=300)
    a, b = _curve(tmp_path / "whole"), _curve(tmp_path / "parts")
    assert sorted(b) == list(range(1, 17)) and all(a[s] == b[s] for s in range(1, 17)), (a, b)


def test_a_one_process_save_and_load_print_no_warning(tmp_path):
    """DCP warns that it assumes one process even when told so (no_dist): in a one-process run that line cut
    the progress bar in two. Any other warning still shows."""
    import warnings

    layer = MoELayer(H, F, {"type": "switch", "num_experts": 4, "top_k": 2})
    opt = torch.optim.Adam(layer.parameters())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        checkpoint.save(tmp_path, 1, layer, opt, {})
        checkpoint.load(checkpoint.latest(tmp_path), layer, opt, {})
    assert not [str(w.message) for w in seen if "torch.distributed is disabled" in str(w.message)]


def test_a_ctrl_c_inside_a_save_reaches_the_trainer_as_ctrl_c():
    """DCP catches every rank's failure, Ctrl-C included, and raises a CheckpointException (a BaseException
    that nothing expects and whose text is a traceback): the Ctrl-C comes out, before any other rank's
    failure that only followed it; a real error comes out as itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    from dist_moe.train.checkpoint.dcp import _unwrapped

    def raised(failures):
        with pytest.raises(BaseException) as info, _unwrapped():
            raise CheckpointException("save failed", {rank: (exc, None) for rank, exc in enumerate(failures)})
        return info.value

    assert type(raised([RuntimeError("peer gone"), KeyboardInterrupt()])) is KeyboardInterrupt
    assert isinstance(raised([OSError(28, "No space left on device")]), OSError)
    assert type(raised([SystemExit(3)])) is CheckpointException  # neither: as DCP raised it
