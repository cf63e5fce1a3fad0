"""A module's buffers (BRANCH anchors and EMA step, DeepSeek-V3 biases, SpecDrop's schedule, load counters)
saved before a step or a routing and put back when what moved them is refused or skipped."""
from __future__ import annotations

import torch
from torch import Tensor


def buffers_of(module) -> list[Tensor]:
    """Copies of a module's buffers (BRANCH anchors and EMA step, DeepSeek-V3 biases, SpecDrop's
    schedule, load counters), for ``put_back`` when what moved them is refused or skipped."""
    return [b.detach().clone() for b in module.buffers()]


def put_back(module, saved: list[Tensor]) -> None:
    """The buffers ``buffers_of`` copied, restored in place."""
    with torch.no_grad():
        for b, old in zip(module.buffers(), saved):
            b.copy_(old)


def put_back_if(module, saved: list[Tensor], skipped: Tensor) -> None:
    """``put_back`` decided on the device: each buffer becomes its copy where ``skipped`` (a 0-dim
    tensor, nonzero: put back) says so, with no host read."""
    with torch.no_grad():
        keep = skipped.bool()
        for b, old in zip(module.buffers(), saved):
            b.copy_(torch.where(keep, old, b))
