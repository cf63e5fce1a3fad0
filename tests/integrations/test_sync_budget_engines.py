"""The engines' own-dispatcher hosts stall the device no more than the engines' own routers do.

On a GPU a host read or a tensor built from Python data stalls the stream (tests/support/sync_budget.py
counts both on any device). DeepSpeed's MoE layer with ``DistMoEGate`` against the same layer with
DeepSpeed's TopKGate (top-2; dropless and with capacity), and Megatron's MoELayer with
``DistMoERouter`` against the same layer with Megatron's TopKRouter (alltoall and allgather
dispatchers): one forward and backward of each, counted on every rank of 2 gloo ranks, the
reference measured in the same run. A planted read on rank 1 only must fail the check on rank 1
and no other.

Megatron: ``DistMoERouter``'s agreement (one small all-reduce, read back, so that every rank refuses
a bad input together before Megatron's exchange) is the one read TopKRouter does not have; it is
counted apart and held to one per forward.
"""
import json

import pytest

from tests.support.dist_utils import run_workers

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'dist-moe[megatron]')")
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'dist-moe[deepspeed]')")

WORLD, H, F, E, T = 2, 16, 32, 4, 24
ROUTER = {"type": "switch", "num_experts": E, "top_k": 2, "jitter_eps": 0.0, "aux_loss_coeff": 0.01}
AGREEMENT = ("dist_moe/dispatch/agree.py", "agree")  # the Megatron host's one read beyond TopKRouter's
# what dist-moe's own code (a frame in dist_moe/) may stall per forward, on top of the engine's layer:
# the agreement, and DeepSpeed's dropless capacity (a host int that sizes its buffers); none in backward
OWN_BUDGET = {"deepspeed dropless": 2, "deepspeed capacity 1.25": 1, "megatron alltoall": 1,
              "megatron allgather": 1}
PLANTED_ON = 1
# frames that count as the engine's: its own code, and the CPU stand-in for its split sizes' device-to-host copy
ENGINE_CODE = ("?", "dist_moe/integrations/megatron/patches.py")


def _count(rank, run):
    """(forward counter, backward counter) of one step after a warm-up step."""
    import torch

    from tests.support.sync_budget import counting

    x = torch.randn(T, H, generator=torch.Generator().manual_seed(10 + rank), requires_grad=True)
    run(x).backward()  # one-time moves and caches
    with counting() as forward:
        loss = run(x)
    with counting() as backward:
        loss.backward()
    return forward, backward


def _row(rank, engine, case, ours, theirs):
    (f, b), (rf, rb) = ours, theirs
    agreement = sum(n for (what, file, fn, _), n in f.sites.items() if (file, fn) == AGREEMENT)
    own = sum(n for (what, file, fn, _), n in [*f.sites.items(), *b.sites.items()] if file not in ENGINE_CODE)
    return {"rank": rank, "engine": engine, "case": case, "planted": False, "forward": f.total,
            "backward": b.total, "agreement": agreement, "own": own, "ref_forward": rf.total, "ref_backward": rb.total,
            "where": f.where() + [f"backward: {w}" for w in b.where()]}


def _deepspeed_rows(rank, plant):
    import torch
    from deepspeed.moe.layer import MoE

    from dist_moe.integrations.deepspeed import deepspeed_moe_layer
    from dist_moe.moe.experts import SingleExpert

    rows = []
    for case, capacity in (("dropless", None), ("capacity 1.25", 1.25)):
        torch.manual_seed(0)
        theirs = MoE(H, SingleExpert(H, F), num_experts=E, ep_size=WORLD, k=2, capacity_factor=capacity or 1.0,
                     drop_tokens=capacity is not None)
        ours = deepspeed_moe_layer(H, F, dict(ROUTER), ep_size=WORLD, capacity_factor=capacity)
        for layer in (theirs, ours):
            layer.set_deepspeed_parallelism()

        def run(layer):
            def step(x):
                y, l_aux, _ = layer(x)
                return y.square().sum() + l_aux
            return step

        rows.append(_row(rank, "deepspeed", case, *_counted_pair(rank, run(ours), run(theirs), plant)))
    return rows


def _megatron_rows(rank, plant):
    import torch
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from dist_moe.integrations.megatron import megatron_config, megatron_moe_layer

    rows = []
    for dispatcher in ("alltoall", "allgather"):
        config = megatron_config(H, F, E, 2, WORLD, moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=0.01)
        torch.manual_seed(0)
        spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
        theirs = MoELayer(config, submodules=spec.submodules)  # TopKRouter
        ours = megatron_moe_layer(config, dict(ROUTER))

        def run(layer):
            def step(x):
                y, _ = layer(x.unsqueeze(1))
                return y.square().sum()  # the aux loss rides on the probs
            return step

        rows.append(_row(rank, "megatron", dispatcher, *_counted_pair(rank, run(ours), run(theirs), plant)))
    return rows


def _counted_pair(rank, ours, theirs, plant):
    """(our host's count, the engine's own router's count), ``plant`` (if any) active for ours only."""
    ref = _count(rank, theirs)
    undo = plant() if plant else (lambda: None)
    try:
        return _count(rank, ours), ref
    finally:
        undo()


def _plant_read():
    """One extra host read at the start of every engine-hosted router's forward (both engines' hosts
    flatten their tokens through ``context_tokens``)."""
    from dist_moe.integrations import context
    from dist_moe.integrations.deepspeed import layer as deepspeed
    from dist_moe.integrations.megatron import router as megatron_router

    original = context.context_tokens

    def planted(h, *args):
        float(h.sum())
        return original(h, *args)

    for module in (deepspeed, megatron_router):
        module.context_tokens = planted

    def undo():
        for module in (deepspeed, megatron_router):
            module.context_tokens = original
    return undo


def _worker(rank, world, out_dir):
    from dist_moe.integrations.megatron import patches as megatron_patches

    megatron_patches.apply()
    from megatron.core import parallel_state

    from dist_moe.integrations.deepspeed import init_distributed

    init_distributed()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    try:
        rows = _deepspeed_rows(rank, None) + _megatron_rows(rank, None)
        plant = _plant_read if rank == PLANTED_ON else None  # the same runs, a read planted on one rank
        rows += [dict(r, planted=True) for r in _deepspeed_rows(rank, plant) + _megatron_rows(rank, plant)]
    finally:
        megatron_patches.release_parallel_state()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(rows, f)


def over_budget(rows: list[dict]) -> list[str]:
    """Rows whose forward or backward stalls exceed the engine's own router's layer (Megatron: plus its
    one agreement), or whose dist-moe code stalls more than ``OWN_BUDGET``."""
    out = []
    for r in rows:
        allowed = r["ref_forward"] + (min(r["agreement"], 1) if r["engine"] == "megatron" else 0)
        own = OWN_BUDGET[f"{r['engine']} {r['case']}"]
        if r["forward"] > allowed or r["backward"] > r["ref_backward"] or r["own"] > own:
            out.append(f"rank {r['rank']} {r['engine']} {r['case']}: forward {r['forward']} (engine's own "
                       f"{r['ref_forward']}), backward {r['backward']} (engine's own {r['ref_backward']}), "
                       f"{r['own']} in dist-moe's code (budget {own}); " + "; ".join(r["where"]))
    return out


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine_syncs")
    run_workers(_worker, WORLD, args=(str(out),), timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_engine_hosts_stall_no_more_than_the_engines_own_routers_on_every_rank(counted):
    print("\nhost stalls per forward / backward, ours vs the engine's own router (every rank):")
    for rows in counted:
        for r in rows:
            if not r["planted"]:
                print(f"  rank {r['rank']} {r['engine']:<9} {r['case']:<14} {r['forward']} / {r['backward']} vs "
                      f"{r['ref_forward']} / {r['ref_backward']} (dist-moe's {r['own']}, agreement {r['agreement']})")
    for rank, rows in enumerate(counted):
        clean = [r for r in rows if not r["planted"]]
        assert len(clean) == 4, (rank, len(clean))
        over = over_budget(clean)
        assert not over, f"rank {rank} over budget:\n" + "\n".join(over)


def test_a_planted_read_on_one_rank_fails_the_check_on_that_rank_only(counted):
    for rank, rows in enumerate(counted):
        planted = [r for r in rows if r["planted"]]
        assert len(planted) == 4, (rank, len(planted))
        for r in planted:  # each host row on its own
            over = over_budget([r])
            if rank == PLANTED_ON:
                assert over, f"the planted read on rank {rank} ({r['engine']} {r['case']}) was not counted"
            else:
                assert not over, f"rank {rank} has no plant but is over budget: {over}"
