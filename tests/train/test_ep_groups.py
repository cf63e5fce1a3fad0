"""Expert-parallel groups smaller than the world (``parallel.ep_size``, ``parallel.ep_layout``): training on 4
ranks accounted as 2 nodes x 2, as EP 4, as EP 2 x 2 replicas contiguous and as EP 2 x 2 strided, equals one
process holding every expert, with the same global batch: every step's loss, and every weight and Adam
moment after the steps (Adam's first moment is the gradients' running sum), for rank and node dedup and
1 and 3 chunks. Each run resumes the one process's first checkpoint, so the checkpoint also reshards from
one process to each layout, and two layouts' checkpoints are resumed in another layout for one more step."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from placement import Topology
from placement.ep_groups import ExpertLayout, group_topology, ring_allreduce_bytes
from tests.support.dist_utils import run_cases

GLOBAL_BATCH = 64
# what a launcher sets: the 4 ranks accounted as 2 nodes x 2
LAUNCHED = {"WORLD_SIZE": "4", "DIST_MOE_TOPOLOGY": "node=2,gpu=2"}
# max_grad_norm: the clip acts at every step, so the global norm (the experts' squares summed once) counts
RUN = ["data.max_rows=1200", "router.num_experts=8", "router.top_k=2", "model.capacity_factor=null",
       "train.log_every=1", "train.checkpoint_every=1", "train.max_grad_norm=0.01"]
# (ep_size, layout, dedup, chunks)
CASES = [(4, "contiguous", "rank", 1), (4, "contiguous", "node", 3), (2, "contiguous", "rank", 3),
         (2, "contiguous", "node", 1), (2, "strided", "node", 3), (2, "strided", "rank", 1)]


def _train(out: Path, world: int, steps: int, *more: str) -> None:
    from dist_moe.train.config import load_config
    from dist_moe.train.trainer import train

    train(load_config(None, [*RUN, f"output.dir={out}", f"train.batch_size={GLOBAL_BATCH // world}",
                             f"train.max_steps={steps}", *more]), quiet=True)


def _resume_worker(rank, world, out, data, ep, layout, dedup, chunks, steps=3):
    os.environ.update(LAUNCHED, DIST_MOE_DATA=data)
    _train(Path(out), world, steps, f"parallel.ep_size={ep}", f"parallel.ep_layout={layout}",
           f"parallel.dedup={dedup}", f"parallel.pipeline_chunks={chunks}", "train.resume=true")


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _tensors(out: Path, step: int = 3) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(out / "checkpoints" / f"step-{step}"), str(out / f"step{step}.pt"))  # our own files
    return torch.load(out / f"step{step}.pt", weights_only=True)


def _same(got: dict, want: dict, where) -> None:
    compared = [k for k in want if k.startswith(("model.", "optim.")) and want[k].is_floating_point()]
    assert any(".experts." in k and k.startswith("optim.") for k in compared)
    for k in compared:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4, msg=f"{where} {k}")


# a layout's step-3 checkpoint resumed in another for step 4: EP 2 x 2 contiguous as EP 4, EP 4 as EP 2 x 2 strided
RESHARDS = {(2, "contiguous", "node", 1): (4, "contiguous", "rank", 3),
            (4, "contiguous", "rank", 1): (2, "strided", "node", 1)}


def test_every_layout_trains_as_one_process_holding_every_expert(tmp_path, monkeypatch):
    data = str(tmp_path / "data")
    monkeypatch.setenv("DIST_MOE_DATA", data)
    one = tmp_path / "one"
    _train(one, 1, 1)  # step 1's checkpoint: where every run starts from
    runs = {case: tmp_path / "ep{}-{}-{}-{}".format(*case) for case in CASES}
    for out in runs.values():
        shutil.copytree(one, out)
    _train(one, 1, 4, "train.resume=true")
    resharded = [(_resume_worker, str(runs[case]), data, *then, 4) for case, then in RESHARDS.items()]
    run_cases(4, [(_resume_worker, str(out), data, *case) for case, out in runs.items()] + resharded, timeout=400)
    want_loss = _losses(one)
    for case, out in runs.items():
        losses, last = _losses(out), 4 if case in RESHARDS else 3
        assert sorted(losses) == list(range(1, last + 1)), (case, losses)
        for step in range(2, last + 1):
            assert abs(losses[step] - want_loss[step]) < 1e-5, (case, step, losses[step], want_loss[step])
        for step in range(3, last + 1):
            _same(_tensors(out, step), _tensors(one, step), (case, step))
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["ep_size"], summary["world_size"], summary["topology"]) == (RESHARDS.get(case, case)[0], 4,
                                                                                   "node=2,gpu=2")
        _check_grad_bytes(out, case, _tensors(one, 3))


def _check_grad_bytes(out: Path, case, state: dict) -> None:
    """Each step's logged expert-gradient bytes by level (every rank's share of its sums, as counted while
    they ran) equal a ring all-reduce of one rank's experts over each replica group."""
    ep, layout = case[0], case[1]
    experts = sum(t.numel() for k, t in state.items() if k.startswith("model.") and ".experts." in k)
    two_by_two = Topology(("node", "gpu"), (2, 2))
    want = {level: 0 for level in two_by_two.levels}
    for group in ExpertLayout(two_by_two, ep, layout).replica_groups():
        for level, sent in ring_allreduce_bytes(group, experts // ep, 4, two_by_two).items():
            want[level] += sent
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in [r for r in rows if "loss" in r and r["step"] in (2, 3)]:  # this layout's steps
        logged = {level: row[f"grad_bytes_{level}"] for level in want if f"grad_bytes_{level}" in row}
        assert logged == (want if ep < 4 else {}), (case, row["step"], logged, want)
    if ep < 4:
        assert want["node" if layout == "contiguous" else "gpu"] > 0  # replicas across the nodes, or inside them


# (engine, dedup, chunks): EP 2 x 2 contiguous (the engines' own groups); rank dedup, 1 chunk: the engine's own
# dispatcher (parallel.dispatcher auto), node dedup, 3 chunks: dist-moe's
ENGINE_CASES = [("megatron", "rank", 1), ("megatron", "node", 3), ("deepspeed", "rank", 1), ("deepspeed", "node", 3)]


# DeepSpeed clips by the mean of every rank's own gradient norm (deepspeed/runtime/utils.py clip_grad_norm_),
# not by the global norm one process sees, whatever the expert-parallel size: its runs compare unclipped
ENGINE = {"megatron": [], "deepspeed": ["train.max_grad_norm=null"]}


def _engine_worker(rank, world, out, data, engine, dedup, chunks):
    os.environ.update(LAUNCHED, DIST_MOE_DATA=data, LOCAL_RANK=str(rank))
    _train(Path(out), world, 3, f"engine={engine}", *ENGINE[engine], "parallel.ep_size=2", f"parallel.dedup={dedup}",
           f"parallel.pipeline_chunks={chunks}", "train.resume=true")


def test_megatron_and_deepspeed_ep_groups_train_as_one_process(tmp_path, monkeypatch):
    """DeepSpeed's ep_size and Megatron's expert_model_parallel_size smaller than the world, with their
    expert-data-parallel groups, through their own dispatchers and dist-moe's."""
    data = str(tmp_path / "data")
    monkeypatch.setenv("DIST_MOE_DATA", data)
    runs, want = {}, {}
    for engine in ("megatron", "deepspeed"):
        one = tmp_path / f"one-{engine}"
        _train(one, 1, 1, f"engine={engine}", *ENGINE[engine])
        for case in [c for c in ENGINE_CASES if c[0] == engine]:
            runs[case] = tmp_path / "{}-{}-{}".format(*case)
            shutil.copytree(one, runs[case])
        _train(one, 1, 3, f"engine={engine}", *ENGINE[engine], "train.resume=true")
        want[engine] = (_tensors(one), _losses(one))
    run_cases(4, [(_engine_worker, str(out), data, *case) for case, out in runs.items()], timeout=400)
    for case, out in runs.items():
        tensors, losses = want[case[0]]
        got_losses, got = _losses(out), _tensors(out)
        for step in (2, 3):
            assert abs(got_losses[step] - losses[step]) < 1e-5, (case, step, got_losses[step], losses[step])
        for k, t in tensors.items():
            if k.startswith(("model.", "optim.")) and t.is_floating_point():
                torch.testing.assert_close(got[k], t, atol=1e-5, rtol=1e-4, msg=f"{case} {k}")
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["engine"], summary["ep_size"], summary["topology"]) == (case[0], 2, "node=2,gpu=2")


def test_groups_replicas_and_their_topologies():
    two_by_two = Topology(("node", "gpu"), (2, 2))
    contiguous, strided = ExpertLayout(two_by_two, 2, "contiguous"), ExpertLayout(two_by_two, 2, "strided")
    assert contiguous.ep_groups() == [[0, 1], [2, 3]] and contiguous.replica_groups() == [[0, 2], [1, 3]]
    assert strided.ep_groups() == [[0, 2], [1, 3]] and strided.replica_groups() == [[0, 1], [2, 3]]
    assert contiguous.group_topology(3).sizes == (1, 2) and strided.group_topology(3).sizes == (2, 1)
    assert ExpertLayout(Topology(("node", "gpu"), (2, 4)), 4, "strided").group_topology(5).sizes == (2, 2)
    assert ExpertLayout(two_by_two, 4).replica_groups() == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="parallel.ep_size=3 must divide the world of 4 ranks"):
        ExpertLayout(two_by_two, 3)
    with pytest.raises(ValueError, match=r"ranks \[0, 1, 2\] holds an uneven number of gpus per node"):
        group_topology(Topology(("node", "gpu"), (2, 2)), [0, 1, 2])


def test_ring_bytes_per_level_sum_to_twice_the_buffer_per_hop():
    topo = Topology(("node", "gpu"), (2, 2))
    assert ring_allreduce_bytes([0, 2], 10, 4, topo) == {"node": 2 * 10 * 4, "gpu": 0}  # 2 ranks: the buffer each
    four = ring_allreduce_bytes([0, 1, 2, 3], 10, 4, topo)
    assert sum(four.values()) == 2 * 3 * 10 * 4 and four["node"] == four["gpu"]  # hops 1->2 and 3->0 cross


def test_node_dedup_in_groups_inside_a_node_is_said_to_run_as_rank_dedup():
    from dist_moe.train.runtime import node_dedup_inside_a_node

    two_by_two = Topology(("node", "gpu"), (2, 2))
    said = node_dedup_inside_a_node("node", ExpertLayout(two_by_two, 2, "contiguous"))
    assert said and "node dedup runs as rank dedup" in said and "group of 2 ranks" in said
    one_node = Topology(("node", "gpu"), (1, 4))
    for dedup, layout in [("rank", ExpertLayout(two_by_two, 2)), ("node", ExpertLayout(two_by_two, 2, "strided")),
                          ("node", ExpertLayout(two_by_two, 4)), ("node", ExpertLayout(one_node, 2))]:
        assert node_dedup_inside_a_node(dedup, layout) is None, (dedup, layout.describe())


REFUSED = [
    (["parallel.ep_size=3"], "parallel.ep_size=3 must divide the world of 4 ranks"),
    (["parallel.ep_size=8"], "parallel.ep_size=8 must divide the world of 4 ranks"),
    (["engine=megatron", "parallel.ep_size=2", "parallel.ep_layout=strided"],
     "parallel.ep_layout=strided: Megatron-core builds its expert-parallel groups of parallel.ep_size=2 from "
     "consecutive ranks (expert_model_parallel_size)"),
    (["engine=deepspeed", "parallel.ep_size=2", "parallel.ep_layout=strided"],
     "parallel.ep_layout=strided: DeepSpeed builds its expert-parallel groups"),
    (["router.type=switch", "train.gar.lambda=0.001", "parallel.ep_size=2"],
     "train.gar with parallel.ep_size=2 of 4 ranks: GAR sums each expert's observations and gradients over its "
     "expert-parallel group"),
    (["parallel.ep_size=2", "parallel.placement=PLACEMENT"],
     "places 8 experts on 4 ranks, but this run has 8 experts on 2 ranks in each expert-parallel group "
     "(parallel.ep_size=2)"),
    (["parallel.ep_size=auto", "parallel.placement=PLACEMENT"],
     "parallel.ep_size=auto with parallel.placement='"),
]


def _refused_worker(rank, world, out, data, placement):
    from dist_moe.train.config import load_config
    from dist_moe.train.trainer import train

    os.environ.update(LAUNCHED, DIST_MOE_DATA=data, LOCAL_RANK=str(rank))
    for i, (overrides, message) in enumerate(REFUSED):
        overrides = [o.replace("PLACEMENT", placement) for o in overrides]
        cfg = load_config(None, [*RUN, "train.max_steps=1", f"output.dir={out}/{i}", *overrides])
        with pytest.raises(ValueError) as refused:  # on every rank, before a step
            train(cfg, quiet=True)
        assert message in str(refused.value), (rank, str(refused.value))


def test_what_cannot_hold_under_torch_megatron_or_deepspeed_is_refused_in_one_line_on_every_rank(tmp_path):
    from placement import Placement

    Placement.contiguous(8, 4).to_yaml(tmp_path / "placement.yaml")  # for groups of 4
    run_cases(4, [(_refused_worker, str(tmp_path / "runs"), str(tmp_path / "data"), str(tmp_path / "placement.yaml"))],
              timeout=300)
    assert not any((tmp_path / "runs").glob("*/metrics.jsonl"))


def test_auto_takes_the_layout_plan_prices_fastest_among_those_its_engine_builds():
    from dist_moe.train.config import load_config
    from dist_moe.train.layout_choice import choose_layout, moe_shape
    from placement.layouts import price_layouts

    topo = Topology(("node", "gpu"), (2, 2))
    # a big LM on a slow node link: the choice is the plan's fastest row for the run's own dedup
    cfg = load_config(None, ["model.kind=lm", "data.name=corpus", "model.d_model=256", "model.ffn_hidden_size=1024",
                             "router.num_experts=8", "parallel.dedup=node", "parallel.ep_size=auto"])
    slow = Topology(topo.levels, topo.sizes, topo.cost.updated({"node": {"bandwidth_Bps": 5e7}}))
    chosen, said = choose_layout(cfg, slow, 1e12)
    plan = price_layouts(moe_shape(cfg), slow, None, 0.1, None, (1,), 1e12)["layouts"]
    step = {(r["ep"], r["layout"]): min(x["step_seconds"] for x in r["rows"] if x["dedup"] == "node"
                                        and x["placement"] == "contiguous") + r["grad_seconds"] for r in plan}
    assert (chosen.parallel.ep_size, chosen.parallel.ep_layout) == min(step, key=step.get)
    assert said.startswith(f"parallel.ep_size=auto: EP {chosen.parallel.ep_size} x ") and "fastest of 4 layouts" in said
    megatron, _ = choose_layout(load_config(None, ["engine=megatron", "model.capacity_factor=null",
                                                   "parallel.ep_size=auto", "router.num_experts=8"]), slow, 1e12)
    assert megatron.parallel.ep_layout == "contiguous"  # the engines build consecutive groups only
    # nothing fits: the layout whose ranks hold the fewest experts (EP 4), said so
    shed, said = choose_layout(cfg, slow, 1.0)
    assert shed.parallel.ep_size == 4 and "none of 4 layouts fits this rank's memory" in said
    with pytest.raises(ValueError, match="a placement file fixes the group size"):
        choose_layout(load_config(None, ["parallel.ep_size=auto", "parallel.placement=p.yaml"]), topo, 1e12)
