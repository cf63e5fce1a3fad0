"""An error of one rank raised on every rank, so none is left waiting in a collective for a peer that has
already stopped: start-up checks run on every rank (the output directory, the run lock, the checkpoint to
resume), and the main rank's failure while it writes (the model export)."""
from __future__ import annotations

import torch.distributed as dist


def agree_on_errors(check, group=None) -> None:
    """Run ``check()`` (start-up checks: output directory, run lock, checkpoint) on every rank; a
    ValueError on any rank is raised on every rank, so none is left waiting in the first collective
    for a peer that has already stopped."""
    error = None
    try:
        check()
    except ValueError as e:
        error = e
    mine = None if error is None else (str(error) or type(error).__name__)
    messages = _told_by_every_rank(mine, group)
    bad = [(rank, m) for rank, m in enumerate(messages) if m]
    if bad:
        rank, message = bad[0]
        if message == mine and error is not None:
            raise error  # this rank's own, its type kept (a CheckpointError stays one)
        raise ValueError(f"rank {rank}: {message}")


def raise_on_every_rank(failure: BaseException | None, group) -> None:
    """The main rank's ``failure`` (or nothing) raised on every rank of ``group``: the main rank's own, a
    copy on the others (strings and numbers only cross)."""
    told = None if failure is None else (
        (failure.errno, failure.strerror, failure.filename) if isinstance(failure, OSError) else str(failure))
    every = _told_by_every_rank(told, group)
    if failure is not None:
        raise failure
    rank, told = next(((r, t) for r, t in enumerate(every) if t is not None), (None, None))
    if isinstance(told, tuple):
        raise OSError(*told)
    if told is not None:
        raise ValueError(f"rank {rank}: {told}")


def _told_by_every_rank(told, group) -> list:
    """What each rank of ``group`` told (strings, numbers and their tuples from peers, never from disk)."""
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, told, group=group)
        return every
    return [told]
