"""Random streams that leave the global ones as they were."""
from __future__ import annotations

import contextlib

import torch


def fork_rng():
    """``torch.random.fork_rng`` over the CPU and, once CUDA is in use, the current GPU: a
    ``torch.manual_seed`` inside (per-rank expert initialisation, a router probe) reseeds every
    device, so the GPU's stream must be restored too, not only the CPU's."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else [])


@contextlib.contextmanager
def per_rank_draw(rank: int):
    """Draws of this rank's own (its experts: one global seed would give every rank the same), from a
    stream of its own that leaves the global one where it was, so the replicated modules built next
    stay identical across ranks."""
    with fork_rng():
        torch.manual_seed(torch.initial_seed() + 1 + rank)
        yield
