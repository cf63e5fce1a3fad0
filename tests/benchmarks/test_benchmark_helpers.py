"""The benchmarks' shared helpers keep working as the trainer's config grows (they broke once)."""
import pytest
import torch

from benchmarks.common import ROUTERS, optimized_placement, train_router
from placement import Topology


def test_trained_router_and_its_optimized_placement(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path))
    topo = Topology(("node", "gpu"), (2, 2))
    model, data = train_router(ROUTERS["branch"], torch.zeros(16, dtype=torch.long), epochs=1)
    with torch.no_grad():
        logits, _ = model(data.x_val)
    assert float((logits.argmax(-1) == data.y_val).double().mean()) > 0.7  # it learned magic
    placement = optimized_placement(model, data, topo)
    assert sorted(placement.expert_to_rank) == [r for r in range(4) for _ in range(4)]


def test_paired_ratios_cancel_what_slows_both_arms():
    """A load that doubles both arms of a repetition leaves its ratio alone: the median and the quartiles are of
    each repetition's own ratio."""
    from benchmarks.paired import paired_ratio, ratio_text

    den = [1.0, 3.0, 1.0, 3.0, 1.0]  # another job on the cores in the second and fourth repetitions
    num = [1.2, 3.6, 1.2, 3.6, 1.2]
    assert paired_ratio(num, den) == pytest.approx((1.2, 1.2, 1.2))
    # paired wrongly (the load in one arm's time only), the spread shows it
    assert paired_ratio(num[1:] + num[:1], den) == pytest.approx((1.2, 0.4, 3.6))
    assert ratio_text([1.0, 3.0, 2.0, 4.0], [1.0, 1.0, 1.0, 1.0]) == "2.50x (1.75-3.25, middle half of 4 paired " \
        "repetitions)"
    with pytest.raises(ValueError, match="same number of repetitions"):
        paired_ratio([1.0], [1.0, 2.0])


def _time_two_arms(rank, world_size, out):
    from benchmarks.paired import interleaved

    order = []
    times = interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 3)
    torch.save((order, times), f"{out}/{rank}.pt")


def test_interleaved_arms_take_turns_and_agree_on_every_rank(tmp_path):
    from tests.support.dist_utils import run_workers

    run_workers(_time_two_arms, 2, args=(str(tmp_path),), timeout=60)
    got = [torch.load(tmp_path / f"{rank}.pt", weights_only=True) for rank in range(2)]
    for order, times in got:
        assert order == ["a", "b"] * 4  # one warm-up round, then 3 in turn
        assert [len(t) for t in times.values()] == [3, 3]
    assert got[0][1] == got[1][1]  # the slowest rank's seconds: the same numbers on each rank
