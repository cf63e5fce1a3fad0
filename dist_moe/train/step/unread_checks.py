"""The routers' input checks a GPU keeps on the device (``dist_moe/routing/input_checks.py``): taken at the
log step, read in its one transfer, and a failure raised on every rank as the line the CPU raises at once."""
from __future__ import annotations

import torch

from dist_moe.distributed.every_rank import agree_on_errors
from dist_moe.routing.input_checks import first_failure

FAILED = "router_input_failed"  # the log step's record key: any rank's failure, summed over ranks


def take_unread(routers) -> torch.Tensor | None:
    """[routers, 5] rows of the checks made since the last log step, or None (checks read at once)."""
    rows = [r.take_unread_check() for r in routers if hasattr(r, "take_unread_check")]
    rows = [row for row in rows if row is not None]
    return torch.stack(rows) if rows else None


def raise_failed(rows: torch.Tensor, failed_anywhere: float, group) -> None:
    """When any rank's checks failed (``failed_anywhere`` > 0, agreed in the log step's reduction): the
    first failing rank's line on every rank (``rows``: this rank's, read to the host)."""
    if failed_anywhere <= 0:
        return
    mine = first_failure(rows)

    def check() -> None:
        if mine is not None:
            raise ValueError(mine)

    agree_on_errors(check, group)
