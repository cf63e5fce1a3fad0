"""A router's input checks without a device assert.

On the CPU a check is read at once and a bad input raises one line. On a GPU that read would stall the
stream every forward, so a router alone asserts on the device (torch's ``_assert_async``), which leaves a
"device-side assert triggered" that poisons the CUDA context for every later call. A reader that takes
the checks (the trainer on a GPU sets ``Router.defer_checks``) gets them kept on the device instead, as
one row per router (the first failure since it was last read: constant memory), read with the next read
the training step already makes (the trainer's log step), which raises the same line the CPU gives. The
tests set ``defer_checks`` on the CPU to run that path.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

NOT_FINITE, CATEGORY_RANGE = 1, 2  # what failed; a row is [failed, kind, three numbers its line names]


def check_row(ok: Tensor, kind: int, *numbers: Tensor | int) -> Tensor:
    """[5] float64 on ``ok``'s device: failed (0 or 1), ``kind``, the numbers its line names (exact below 2**53).
    Host numbers are filled in on the device (``torch.full``): no copy from the host in a forward."""
    def on_device(n) -> Tensor:
        if isinstance(n, Tensor):
            return n.to(torch.float64).reshape(())
        return torch.full((), float(n), dtype=torch.float64, device=ok.device)

    values = [on_device(n) for n in (*numbers, *[0] * (3 - len(numbers)))]
    return torch.stack([(~ok).to(torch.float64).reshape(()), on_device(kind), *values])


def keep_first(kept: Tensor | None, row: Tensor) -> Tensor:
    """``kept`` unless it holds no failure, then ``row``: the first failure stays."""
    return row if kept is None else torch.where(kept[0] > 0, kept, row)


def describe(row: Sequence[float]) -> str | None:
    """The one line a failed row says (the CPU's own), or None when it holds no failure."""
    failed, kind, a, b, c = (int(v) for v in row)
    if not failed:
        return None
    if kind == NOT_FINITE:
        return f"router input contains NaN or Inf in {a} of {b} tokens"
    return f"categories out of range [0, {c}): min {a}, max {b}"


def first_failure(rows: Tensor) -> str | None:
    """The first failed row's line of [n, 5] rows read to the host, or None."""
    return next((line for row in rows.tolist() if (line := describe(row)) is not None), None)
