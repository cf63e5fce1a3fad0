"""Every rank of an exchange agrees that it may run, or every rank raises the same error.

Two ways one rank could leave the group's collective order and make its peers pair
the wrong batches without noticing:

* its input is bad (NaN/Inf, category ids out of range) and it raises before the
  exchange while its peers go on;
* a caller caught an exception and went on, so one rank skipped a forward.

So the first exchange of every MoE layer forward carries a small header beside its
split sizes (no extra collective): the layer's forward count (the *tag*) and an input
problem code. Each rank checks the headers it received; a problem anywhere, or a tag
that differs from its own, raises on every rank together. Engine-hosted layers, whose
exchanges are the engine's, agree with ``agree`` (one small all-reduce) instead.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor

from dist_moe.dispatch.wire import WIRE_CODES
from dist_moe.distributed.reductions import reduce_copy

# input_problem's bits, and what each says
INPUT_PROBLEMS = {1: "NaN or Inf in the router input", 2: "category ids out of range"}
_WIRE_NAMES = {code: name for name, code in WIRE_CODES.items()}


def input_problem(x: Tensor, categories: Tensor | None = None, num_categories: int | None = None) -> Tensor:
    """int64 scalar: 0 when ``x`` is finite and every category id lies in [0, num_categories),
    else the sum of the ``INPUT_PROBLEMS`` bits that apply (computed on the device, no host read)."""
    code = (~torch.isfinite(x).all()).long()
    if categories is not None and num_categories is not None and categories.numel():
        code = code + 2 * ((categories < 0) | (categories >= num_categories)).any().long()
    return code


def describe_problem(code: int) -> str:
    return ", ".join(text for bit, text in INPUT_PROBLEMS.items() if code & bit) or "none"


class InputRejected(ValueError):
    """Some rank's MoE input was bad; every rank raises this at the same exchange."""


class OutOfStep(RuntimeError):
    """The ranks of an exchange are at different forwards of the same layer."""


def _rejected(what: str, where: str) -> InputRejected:
    return InputRejected(f"{what} refused its input on every rank: {where}; no tokens were exchanged and "
                         "router state is unchanged")


def _out_of_step(what: str, my_tag: int, others: str) -> OutOfStep:
    return OutOfStep(f"{what} is out of step: this rank is at forward {my_tag}, {others}. A rank skipped a "
                     "forward (an exception caught and ignored?); its batches would pair with the wrong ones, "
                     "so every rank stops here")


def check_headers(tags: list[int], problems: list[int], my_tag: int, what: str = "this MoE layer",
                  wires: list[int] | None = None) -> None:
    """``tags[i]``, ``problems[i]``, ``wires[i]``: what rank i of the group sent (this rank's own entries
    included); the wire codes (``wire.Wire.code``) must all be equal."""
    if wires is not None and len(set(wires)) > 1:
        raise ValueError(f"{what}: the ranks send their rows in different wire dtypes ("
                         + ", ".join(f"rank {i}: {_WIRE_NAMES.get(c, c)}" for i, c in enumerate(wires))
                         + "); set parallel.wire_dtype (or ExchangeConfig.wire_dtype) alike on every rank")
    bad = [f"rank {i} of the expert-parallel group ({describe_problem(p)})" for i, p in enumerate(problems) if p]
    if bad:
        raise _rejected(what, ", ".join(bad))
    off = [f"rank {i} at forward {t}" for i, t in enumerate(tags) if t != my_tag]
    if off:
        raise _out_of_step(what, my_tag, ", ".join(off))


def agree(problem: Tensor, tag: int, group, what: str = "this MoE layer", maxima=()) -> list[int]:
    """One MAX all-reduce over ``group`` of (problem bits, tag, -tag, *maxima); raises like
    ``check_headers``, else returns the group's maxima (e.g. the largest expert load)."""
    code = problem.reshape(()).long()
    # made on the device from scalars (no host-to-device copy of a Python list)
    t = torch.stack([code, *(code.new_full((), v) for v in (tag, -tag, *maxima))])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = reduce_copy(t, group, dist.ReduceOp.MAX)
    worst, high, low, *agreed = t.tolist()
    if worst:  # the largest code over the ranks: enough to say what went wrong
        raise _rejected(what, f"{describe_problem(worst)} on a rank of the group "
                              f"(this rank: {describe_problem(int(problem))})")
    if high != tag or -low != tag:
        raise _out_of_step(what, tag, f"other ranks between forward {-low} and {high}")
    return agreed


@contextlib.contextmanager
def agreed_routing(router):
    """Route inside this block with the data checks left to the agreement (``input_problem``,
    then ``check_headers`` or ``agree``); when the agreement refuses, the router's buffers
    (anchors, biases, schedules) go back to what they were, and the error goes on."""
    with router.checks_by_caller(), router.restored_on(InputRejected, OutOfStep):
        yield
