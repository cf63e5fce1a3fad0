"""``deterministic`` (train.deterministic): every float sum of an MoE layer's forward and backward runs in
a fixed order. On a GPU, index_add, scatter_add and index_put(accumulate=True) add with atomics, so a
row with three or more contributions sums them in any order; no such op may run in a deterministic
layer's forward or backward, for any router (counted on aten ops, which a GPU run dispatches alike).
Torch's deterministic mode accepts every op the layer runs, the fixed-order sums give the layer's
numbers, and a 2-rank training run with train.deterministic repeats bit for bit."""
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist_moe import MoELayer
from dist_moe.dispatch.combine import row_places, sum_rows, take_rows
from tests.support.dist_utils import run_workers
from tests.support.ep_checks import ROUTERS

_ACCUMULATING = {"aten.index_add", "aten.index_add_", "aten.scatter_add", "aten.scatter_add_", "aten.scatter_reduce",
                 "aten.scatter_reduce_", "aten.index_reduce", "aten.index_reduce_", "aten.put", "aten.put_"}
_INDEX_PUT = {"aten.index_put", "aten.index_put_", "aten._index_put_impl_"}
_OURS = str(Path(__file__).resolve().parents[2] / "dist_moe")


class FloatAccumulations(TorchDispatchMode):
    """Counts the float accumulate-by-index ops a forward and backward run, with where each came from:
    the innermost dist_moe frame in forward, the autograd node in backward."""

    def __init__(self):
        super().__init__()
        self.sites: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        accumulates = name in _ACCUMULATING or name in _INDEX_PUT and (
            kwargs.get("accumulate") or len(args) > 3 and args[3] is True)
        if accumulates and args[0].is_floating_point():
            self.sites[f"{name} at {_where()}"] += 1
        return func(*args, **kwargs)


def _where() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_OURS):
            return f"{frame.f_code.co_filename[len(_OURS) - 8:]}:{frame.f_lineno}"
        frame = frame.f_back
    node = torch._C._current_autograd_node()
    return f"backward {node.name()}" if node is not None else "?"


CASES = {  # (hidden, layer keywords): grouped experts; looped ones (rows of 40 bytes); slots dropped
    "grouped": (8, {}),
    "looped": (10, {}),
    "dropping": (8, {"capacity_factor": 0.5}),
}


def _layer(router: str, case: str, deterministic: bool, seed: int = 0) -> tuple[MoELayer, int]:
    hidden, kw = CASES[case]
    torch.manual_seed(seed)
    return MoELayer(hidden, 12, dict(ROUTERS[router]), shared_expert_hidden=6, deterministic=deterministic,
                    **kw), hidden


def _forward_backward(layer: MoELayer, hidden: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, hidden, generator=g, requires_grad=True)
    y, aux = layer(x, categories=torch.randint(0, 5, (3,), generator=g), token_ids=torch.arange(21).reshape(3, 7))
    (y.square().sum() + aux).backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_float_accumulation_runs_in_a_deterministic_layer(case):
    found = {}
    for router in ROUTERS:
        layer, hidden = _layer(router, case, deterministic=True)
        with FloatAccumulations() as ops:
            _forward_backward(layer, hidden)
        if ops.sites:
            found[router] = dict(ops.sites)
    assert not found, f"float accumulations by index in deterministic layers: {found}"


def test_the_count_sees_the_default_layers_index_add():
    """The same count on the default layer (index_add) must find it: the check can fail."""
    layer, hidden = _layer("switch", "grouped", deterministic=False)
    with FloatAccumulations() as ops:
        _forward_backward(layer, hidden)
    assert any(site.startswith("aten.index_add") for site in ops.sites), ops.sites


def test_torch_deterministic_mode_accepts_every_router():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for router in ROUTERS:
            for case in CASES:
                _forward_backward(*_layer(router, case, deterministic=True))
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fixed_order_gives_the_layers_numbers(case):
    for router in ROUTERS:
        results = []
        for deterministic in (False, True):
            layer, hidden = _layer(router, case, deterministic)
            y, gx = _forward_backward(layer, hidden)
            results.append((y, gx, [p.grad for p in layer.parameters() if p.grad is not None]))
        (y0, gx0, g0), (y1, gx1, g1) = results
        assert torch.allclose(y0, y1, atol=1e-6), f"{router}/{case}: outputs differ"
        assert torch.allclose(gx0, gx1, atol=1e-6), f"{router}/{case}: input gradients differ"
        assert len(g0) == len(g1) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g0, g1)), router


def test_row_sums_follow_the_places_not_the_order_of_the_values():
    # float32 sums that depend on their order: 1e8 + 1 rounds the 1 away
    values = torch.tensor([[1e8], [1.0], [-1e8], [1.0], [3.0], [-1e8], [1e8], [1.0]])
    index = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    places = row_places(index, 2, 4)
    assert places.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # each row's contributions in their order
    expected = sum_rows(values, places, 2, 4)
    for seed in range(5):
        perm = torch.randperm(8, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(sum_rows(values[perm], places[perm], 2, 4), expected)
    assert not torch.equal(expected, torch.zeros(2, 1).index_add(0, index.flip(0), values.flip(0)))  # order matters


def test_take_and_sum_rows_are_each_others_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    index = torch.tensor([4, 0, 4, 2, 0, 4])
    places = row_places(index, 5, 3)
    assert torch.autograd.gradcheck(lambda t: take_rows(t, index, places, 3), (x,))
    v = torch.randn(6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: sum_rows(t, places, 5, 3), (v,))
    assert torch.equal(take_rows(x, index, places, 3), x[index])


def test_a_row_over_its_bound_is_refused():
    with pytest.raises(RuntimeError, match="per_row"):
        row_places(torch.tensor([1, 1, 1]), 2, 2)


RUN = ["data.max_rows=1200", "train.batch_size=64", "train.log_every=1", "router.type=switch",
       "router.jitter_eps=0.01", "train.max_steps=6", "train.deterministic=true"]


def _twice_worker(rank, world, out, data):
    import os

    from dist_moe.train.config import load_config
    from dist_moe.train.trainer import train

    os.environ["DIST_MOE_DATA"] = data
    for run in ("first", "second"):
        def keep(model, _data, rt, run=run):
            assert torch.are_deterministic_algorithms_enabled()  # train.deterministic reached torch
            torch.save(model.state_dict(), f"{out}/{run}-rank{rt.rank}.pt")
            return {}

        train(load_config(None, [*RUN, f"output.dir={out}/{run}"]), quiet=True, after=keep)


def test_a_deterministic_two_rank_run_repeats_bit_for_bit(tmp_path):
    run_workers(_twice_worker, 2, args=(str(tmp_path), str(tmp_path / "data")), timeout=240)
    for rank in range(2):
        first, second = (torch.load(tmp_path / f"{run}-rank{rank}.pt") for run in ("first", "second"))
        assert first.keys() == second.keys()
        differ = [k for k in first if not torch.equal(first[k], second[k])]
        assert not differ, f"rank {rank}: weights differ between the runs: {differ}"
    curves = [[json.loads(x)["loss"] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
               if "loss" in json.loads(x)] for run in ("first", "second")]
    assert len(curves[0]) == 6 and curves[0] == curves[1]


def _ep_worker(rank, world, out):
    import torch.distributed as dist

    from placement import Placement, Topology

    topo = Topology(("node", "gpu"), (2, world // 2))
    found = {}
    for dedup in ("rank", "node"):
        for chunks in (1, 3):
            for router in ("switch", "branch", "specdrop"):
                torch.manual_seed(0)
                layer = MoELayer(8, 12, dict(ROUTERS[router]), group=dist.group.WORLD, topology=topo,
                                 placement=Placement.tree_prefix(8, topo), dedup=dedup, pipeline_chunks=chunks,
                                 shared_expert_hidden=6, deterministic=True)
                with FloatAccumulations() as ops:
                    _forward_backward(layer, 8)
                if ops.sites:
                    found[f"{router} {dedup} C={chunks}"] = dict(ops.sites)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(found, f)


def test_no_float_accumulation_in_a_deterministic_expert_parallel_layer_on_every_rank(tmp_path):
    """4 ranks as 2 nodes x 2: rank and node dedup, 1 and 3 chunks, both stages' sums and their backward."""
    run_workers(_ep_worker, 4, args=(str(tmp_path),), timeout=240)
    for rank in range(4):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert not found, f"rank {rank}: float accumulations by index: {found}"


def test_a_row_over_its_places_raises_on_the_cpu_and_asserts_nothing_on_a_device():
    """row_places' bound (a row takes at most per_row) holds by construction; the CPU checks it on every call,
    another device issues no device assert (it would end every later CUDA call of the process)."""
    index = torch.tensor([0, 1, 1, 1])
    assert row_places(index, 2, 3).tolist() == [0, 3, 4, 5]
    with pytest.raises(RuntimeError, match="more contributions than per_row"):
        row_places(index, 2, 2)

    class Asserts(TorchDispatchMode):
        devices: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "_assert_async" in str(func.overloadpacket):
                self.devices.append(args[0].device.type)
            return func(*args, **(kwargs or {}))

    with Asserts() as asserts:
        row_places(index.to("meta"), 2, 2)  # over its places: a device raises nothing
        row_places(index, 2, 3)
    assert asserts.devices == ["cpu"]
