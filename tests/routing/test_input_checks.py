"""A router's input checks on a GPU stay on the device (no device assert, no read per forward) and say,
once read, the line the CPU raises at once; ``defer_checks`` runs that path here."""
import pytest
import torch

from dist_moe.routing import build_router
from dist_moe.routing.input_checks import first_failure


def _cpu_line(router, *args) -> str:
    with pytest.raises(ValueError) as raised:
        router(*args)
    return str(raised.value)


@pytest.mark.parametrize("case", ["not finite", "category out of range"])
def test_a_deferred_check_says_the_cpu_line_and_keeps_the_first_failure(case):
    if case == "not finite":
        router = build_router({"type": "switch", "num_experts": 4, "top_k": 2, "hidden_size": 8})
        bad = torch.randn(6, 8)
        bad[[1, 4], 3] = float("nan")
        worse = torch.full((6, 8), float("inf"))
        args, later = (bad,), (worse,)
    else:
        router = build_router({"type": "specdrop", "num_experts": 4, "num_categories": 3, "p_assigned": 0.5,
                               "p_leak": 0.1})
        x = torch.randn(5, 8)
        args, later = (x, torch.tensor([0, 2, 7, 1, -1])), (x, torch.tensor([9, 9, 9, 9, 9]))
    line = _cpu_line(router, *args)  # the CPU: read at once, one line
    router.defer_checks = True
    good = (torch.randn(6, 8),) if case == "not finite" else (args[0], torch.tensor([0, 1, 2, 1, 0]))
    router(*good)
    router(*args)  # no raise: the check waits on the device
    router(*later)  # a later failure does not replace the first
    router(*good)
    row = router.take_unread_check()
    assert row.shape == (5,) and first_failure(row.unsqueeze(0)) == line
    assert router.take_unread_check() is None  # taken once
    router(*good)
    assert first_failure(router.take_unread_check().unsqueeze(0)) is None


def test_a_deferred_check_neither_reads_nor_builds_in_the_forward():
    from tests.support.sync_budget import counting

    router = build_router({"type": "switch", "num_experts": 4, "top_k": 2, "hidden_size": 8})
    router.defer_checks = True
    x = torch.randn(6, 8)
    x[2, 1] = float("nan")
    router(x)  # the first row kept
    with counting() as seen:
        router(x)  # another kept beside it, on the device
    assert seen.total == 0, seen.where()
