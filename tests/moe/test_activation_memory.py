"""What one MoE layer keeps for backward: under bf16 autocast its rows in bf16 (at most 0.55x fp32's bytes, on
one process and on every rank of an exchange, pipelined or not), and ``placement.activations``' estimate of it
within a few percent of what is measured (summed over the ranks, whose pairs the estimate takes as balanced)."""
from types import SimpleNamespace

from benchmarks.activation_memory import estimate, measure
from tests.support.dist_utils import run_workers

SHAPE = SimpleNamespace(tokens=96, hidden=64, ffn=32, experts=8, top_k=2)
BF16_AT_MOST = 0.55


def test_one_process_keeps_bf16_rows_and_matches_the_estimate():
    m = measure(SHAPE)
    assert m["bf16"] <= BF16_AT_MOST * m["fp32"], m
    for name, size in (("fp32", 4), ("bf16", 2)):
        assert abs(m[name] / estimate(SHAPE, size, None) - 1) < 0.03, (name, m, estimate(SHAPE, size, None))


def _exchange_worker(rank, world):
    import torch.distributed as dist

    for dedup, chunks in (("none", 1), ("rank", 2)):
        m = measure(SHAPE, dedup, chunks, world)
        assert m["bf16"] <= BF16_AT_MOST * m["fp32"], (rank, dedup, chunks, m)
        every = [None] * world
        dist.all_gather_object(every, m)
        if dedup == "none":  # every pair its own copy: the estimate's rows, summed over the ranks
            for name, size in (("fp32", 4), ("bf16", 2)):
                total = sum(r[name] for r in every)
                want = world * estimate(SHAPE, size, size)
                assert abs(total / want - 1) < 0.03, (rank, name, total, want)


def test_an_exchanging_layer_keeps_bf16_rows_on_every_rank():
    run_workers(_exchange_worker, 2)
