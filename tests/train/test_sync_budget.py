"""On a GPU a host read or a tensor built from Python data stalls the device pipeline: the
expert-parallel layer may do either once per exchange in forward (node dedup: twice, one per
stage) and never in backward, for every router, dedup mode and chunk count, with a shared expert
(counted on gloo ranks with the ops that block on CUDA, tests/support/sync_budget.py). Every rank counts
its own and every rank is checked; a planted build and a planted read, each on one rank only,
must be caught on that rank, so the check is seen to fail. The local path (one process) has no stall
at all, and a whole trainer step none but its layers' exchanges (a log step: one read). The engines'
own-dispatcher hosts are counted in tests/integrations/test_sync_budget_engines.py."""
import json

import pytest

from tests.support.dist_utils import run_workers

BUDGET = {"none": 1, "rank": 1, "node": 2}  # reads + builds per forward; 0 in backward
WORLD = 4  # 2 nodes x 2 ranks: both node-dedup stages
# (file, function) whose tensor builds stay on the host and are not counted. Empty: the dispatcher's
# byte ledger is plain Python ints (dispatch/dispatcher.py), it builds no tensor during a forward.
ALLOWED_BUILDS: frozenset = frozenset()
PLANTS = {"build": 3, "read": 1}  # what is planted, on which rank only


def _plant(what: str):
    """Wrap ``DispatchPlan.build`` (the plan every exchange starts from) with one extra build or
    read of the kind a regression would add."""
    from placement.plan import DispatchPlan

    original = DispatchPlan.build.__func__

    def build(cls, expert_idx, *args, **kwargs):
        if what == "build":
            torch_tensor = __import__("torch").tensor
            torch_tensor([1, 2], device=expert_idx.device)
        else:
            int(expert_idx.max())
        return original(cls, expert_idx, *args, **kwargs)

    DispatchPlan.build = classmethod(build)
    return lambda: setattr(DispatchPlan, "build", classmethod(original))


def _layer_run(rank, name, cfg, dedup, chunks, topo, allowed):
    import torch
    import torch.distributed as dist

    from dist_moe import MoELayer
    from placement import Placement
    from tests.support.sync_budget import counting

    torch.manual_seed(0)
    layer = MoELayer(8, 12, dict(cfg), topology=topo, placement=Placement.tree_prefix(8, topo),
                     group=dist.group.WORLD, dedup=dedup, capacity_factor=1.25 if name == "switch" else None,
                     shared_expert_hidden=4, pipeline_chunks=chunks)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(13 + 3 * rank, 8, generator=g, requires_grad=True)
    kw = {"categories": torch.randint(0, 5, (x.shape[0],), generator=g)} if name.startswith("specdrop") else {}
    kw.update({"token_ids": torch.arange(x.shape[0]) * 7919} if name == "hash" else {})
    y, aux = layer(x, **kw)  # a first forward and backward: one-time moves of index tensors
    (y.sum() + aux).backward()
    with counting(allowed) as forward:
        y, aux = layer(x, **kw)
    with counting(allowed) as backward:
        (y.square().sum() + aux).backward()
    return {"run": f"{name} C={chunks}", "dedup": dedup, "rank": rank, "forward": forward.total,
            "forward_reads": forward.reads, "forward_builds": forward.builds, "backward": backward.total,
            "where": forward.where() + [f"backward: {w}" for w in backward.where()]}


def _budget_worker(rank, world, out_dir):
    from placement import Topology
    from tests.support.ep_checks import ROUTERS

    topo = Topology(("node", "gpu"), (2, world // 2))
    rows = [_layer_run(rank, name, cfg, dedup, chunks, topo, ALLOWED_BUILDS)
            for name, cfg in ROUTERS.items() for dedup in ("none", "rank", "node") for chunks in (1, 3)]
    for what, on_rank in PLANTS.items():  # the same check, with a violation on one rank only
        undo = _plant(what) if rank == on_rank else (lambda: None)
        try:
            row = _layer_run(rank, "switch", ROUTERS["switch"], "node", 3, topo, ALLOWED_BUILDS)
        finally:
            undo()
        rows.append(dict(row, run=f"planted {what} on rank {on_rank}"))
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(rows, f)


def over_budget(rows: list[dict]) -> list[str]:
    return [f"rank {r['rank']} {r['run']} {r['dedup']}: forward {r['forward_reads']} reads + "
            f"{r['forward_builds']} builds (budget {BUDGET[r['dedup']]}), backward {r['backward']}; "
            + "; ".join(r["where"])
            for r in rows if r["forward"] > BUDGET[r["dedup"]] or r["backward"] > 0]


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    out = tmp_path_factory.mktemp("syncs")
    run_workers(_budget_worker, WORLD, args=(str(out),), timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_one_host_stall_per_exchange_in_forward_none_in_backward_on_every_rank(counted):
    print(f"\nhost stalls per layer, the most over {WORLD} ranks (forward reads + builds / backward):")
    for i, row in enumerate(counted[0]):
        if row["run"].startswith("planted"):
            continue
        worst = max((ranks[i] for ranks in counted), key=lambda r: (r["forward"], r["backward"]))
        print(f"  {row['run']:<32} {row['dedup']:<4} {worst['forward_reads']} + {worst['forward_builds']} / "
              f"{worst['backward']}")
    for rank, rows in enumerate(counted):
        over = over_budget([r for r in rows if not r["run"].startswith("planted")])
        assert not over, f"rank {rank} over budget:\n" + "\n".join(over)


@pytest.mark.parametrize("what", sorted(PLANTS))
def test_a_planted_stall_on_one_rank_fails_the_budget_on_that_rank(counted, what):
    run = f"planted {what} on rank {PLANTS[what]}"
    for rank, rows in enumerate(counted):
        over = over_budget([r for r in rows if r["run"] == run])
        if rank == PLANTS[what]:
            assert over, f"the planted {what} on rank {rank} was not counted"
        else:
            assert not over, f"rank {rank} has no plant but is over budget: {over}"


# --- the local path (one process, or one expert-parallel rank) and a whole trainer step -------------

def _local_counts(name: str, cfg: dict, plant: bool = False) -> tuple[int, int, list[str]]:
    """(forward, backward, where) of one local MoELayer forward + backward; ``plant``: one read added."""
    import torch

    from dist_moe import MoELayer
    from dist_moe.dispatch import dispatcher
    from tests.support.sync_budget import counting

    torch.manual_seed(0)
    layer = MoELayer(8, 12, dict(cfg), capacity_factor=1.25 if name == "switch" else None, shared_expert_hidden=4)
    x = torch.randn(13, 8, requires_grad=True)
    kw = {"categories": torch.randint(0, 5, (13,))} if name.startswith("specdrop") else {}
    kw.update({"token_ids": torch.arange(13) * 7919} if name == "hash" else {})
    y, aux = layer(x, **kw)
    (y.sum() + aux).backward()
    real = dispatcher.every_slot_pairs
    if plant:
        dispatcher.every_slot_pairs = lambda idx, gates: (int(idx.max()), real(idx, gates))[1]
    try:
        with counting() as forward:
            y, aux = layer(x, **kw)
    finally:
        dispatcher.every_slot_pairs = real
    with counting() as backward:
        (y.square().sum() + aux).backward()
    return forward.total, backward.total, forward.where() + backward.where()


def test_the_local_path_never_stalls_the_host():
    """Every router, one process: no read and no build in forward or backward (grouped experts sized
    on the device, every routing slot a pair, input checks asserted on the device); a planted read fails."""
    from tests.support.ep_checks import ROUTERS

    over = {name: counts for name, cfg in ROUTERS.items() if (counts := _local_counts(name, cfg))[:2] != (0, 0)}
    assert not over, over
    assert _local_counts("switch", ROUTERS["switch"], plant=True)[0] == 1


# host-side by design: the dispatcher's byte ledger (host ints), the log step's host floats and the values
# it read back, placement's and the metrics' math on the log step's one host copy of the routings
TRAINER_BUILDS = frozenset({("dist_moe/dispatch/dispatcher.py", "traffic"),
                            ("dist_moe/train/metrics/log.py", "reduced")})
TRAINER_HOST_ONLY = frozenset({"placement/", "dist_moe/train/metrics/routing.py"})
TRAINER_PLANT_RANK = 1


def _trainer_worker(rank, world, out_dir, plant):

    from dist_moe.train import trainer
    from dist_moe.train.config import load_config
    from dist_moe.train.step import training_step
    from tests.support.sync_budget import counting

    rows = []
    real_step, real_log, real_plain = (trainer._TrainingRun.train_step, trainer._TrainingRun.maybe_log,
                                       training_step.PlainStep.__call__)

    def counted(kind, fn):
        def run(self, *args):
            with counting(TRAINER_BUILDS, TRAINER_HOST_ONLY) as c:
                out = fn(self, *args)
            rows.append({"kind": kind, "step": self.step, "reads": c.reads, "builds": c.builds, "where": c.where()})
            return out
        return run

    def planted(self, *args, **kwargs):  # a host read of the loss, as a step that logged every loss would do
        record = real_plain(self, *args, **kwargs)
        float(record["loss"])
        return record

    trainer._TrainingRun.train_step = counted("step", real_step)
    trainer._TrainingRun.maybe_log = counted("log", real_log)
    if plant and rank == TRAINER_PLANT_RANK:
        training_step.PlainStep.__call__ = planted
    cfg = load_config(None, ["data.max_rows=600", "train.max_steps=4", "train.batch_size=32", "train.log_every=2",
                             f"output.dir={out_dir}/run{int(plant)}", "model.capacity_factor=null"])
    trainer.train(cfg, quiet=True)
    with open(f"{out_dir}/trainer{int(plant)}_rank{rank}.json", "w") as f:
        json.dump(rows, f)


def _trainer_over_budget(rows: list[dict]) -> list[str]:
    """One MoE layer, dedup rank: a step may read once (its exchange); a log step once (its reduction)."""
    return [f"{r['kind']} {r['step']}: {r['reads']} reads + {r['builds']} builds: {r['where']}" for r in rows
            if r["reads"] + r["builds"] > (BUDGET["rank"] if r["kind"] == "step" else 1)]


@pytest.mark.parametrize("plant", [False, True])
def test_a_trainer_step_stalls_only_in_its_exchanges_and_once_per_log(tmp_path, plant):
    """Two ranks, the tabular model: every training step reads back only in its MoE layer's exchange (no
    input screen, loss, skip decision, clip norm or gradient sum on the host), a log step once; a read
    planted on rank 1 fails rank 1 alone."""
    run_workers(_trainer_worker, 2, args=(str(tmp_path), plant), timeout=240)
    for rank in range(2):
        rows = json.loads((tmp_path / f"trainer{int(plant)}_rank{rank}.json").read_text())
        assert len([r for r in rows if r["kind"] == "step"]) == 4
        over = _trainer_over_budget(rows)
        if plant and rank == TRAINER_PLANT_RANK:
            assert len(over) == 4, f"the planted read on rank {rank} was not counted at every step: {rows}"
        else:
            assert not over, f"rank {rank}:\n" + "\n".join(over)
