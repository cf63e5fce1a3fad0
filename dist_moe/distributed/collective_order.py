"""One order of collectives on every rank, across every communicator a training step uses.

A backward runs three kinds of collectives: the experts' exchanges (on the expert-parallel group and,
with node dedup, the node groups), the replicated parameters' gradient sums and the experts' replica
sums (each on a communicator of its own). NCCL runs collectives of different communicators side by side
only while it has connections and streams enough for all of them: under ``CUDA_DEVICE_MAX_CONNECTIONS=1``
(set for Megatron's overlap) kernels queue in the order they were issued, so two ranks that issue the same
collectives in different orders across communicators wait on each other for ever.

The rule here: a gradient sum never starts while an exchange of the step has still to run its backward,
and the sums start in one fixed order (``train/step/grad_overlap.py``). Every rank runs the same exchanges
in the same order (``dispatch/pipeline.py``), so every rank issues the same sequence of collectives over all
its communicators, whichever parameters it left unused (their sums wait in order; nothing starts early).
The exchanges register here when their forward records a backward, and leave when it has run (or when
autograd frees a graph that is never run backward); an engine's layer whose own dispatcher exchanges is
registered by its input (``through_exchanges``)."""
from __future__ import annotations

import weakref

import torch
from torch import Tensor

_PENDING: weakref.WeakSet = weakref.WeakSet()


def exchange_recorded(run) -> None:
    """An exchange whose backward will issue collectives (``run``: its per-forward state, held by the graph)."""
    _PENDING.add(run)


def exchange_done(run) -> None:
    """That exchange's backward has issued and waited for all its collectives."""
    _PENDING.discard(run)


def exchanges_pending() -> int:
    """Exchanges recorded in forward whose backward has not run: while any is, no gradient sum starts."""
    return len(_PENDING)


class _Exchanges:
    """The token an engine's layer registers: its backward's exchanges are those of the engine's dispatcher."""


class _AfterExchanges(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor):
        ctx.token = _Exchanges()
        exchange_recorded(ctx.token)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        exchange_done(ctx.token)  # the layer's input gradient: its whole backward has run
        return grad


def through_exchanges(x: Tensor) -> Tensor:
    """``x`` as the input of a layer whose engine exchanges tokens in its backward (Megatron's and DeepSpeed's
    own dispatchers): registered as an exchange until the gradient of ``x``, the layer's last, is made."""
    return _AfterExchanges.apply(x) if torch.is_grad_enabled() and x.requires_grad else x
