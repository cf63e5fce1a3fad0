"""A layer's step split into its named stages (``dist_moe.dispatch.profiling``), for the benchmarks.

Host seconds per stage on the CPU (gloo), where host time is the time: route, plan (the split
sizes' exchange and its host read, the metadata's exchange), each exchange's wait, experts,
combine, and the backward's; what no stage covers is printed as "other" (issuing the async
sends, the autograd engine, the router's backward). Means over the repeats, then over ranks,
beside the slowest rank's.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist

from dist_moe.dispatch.profiling import ProfileClock

FORWARD = ("route", "plan", "plan_inner", "shared_expert", "dispatch_wait", "dispatch_wait_inner", "experts",
           "combine_wait_inner", "combine_wait", "combine")
BACKWARD = tuple(f"backward.{s}" for s in ("shared_expert", "combine_wait", "combine_wait_inner", "experts",
                                           "dispatch_wait_inner", "gate_grads_wait", "dispatch_wait", "combine"))


def stage_profile(loss_fn, repeats: int = 5) -> dict:
    """{name: (mean over ranks, slowest rank)} seconds per step of ``loss_fn().backward()``: "forward",
    "backward" and every stage (one warm-up step first)."""
    totals: dict = defaultdict(float)
    for i in range(repeats + 1):
        dist.barrier()
        with ProfileClock() as clock:
            start = time.perf_counter()
            loss = loss_fn()
            mid = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
        if i:
            totals["forward"] += mid - start
            totals["backward"] += end - mid
            for name, seconds in clock.seconds.items():
                totals[name] += seconds
    names = ("forward", "backward", *FORWARD, *BACKWARD)
    per_step = torch.tensor([totals[n] / repeats for n in names], dtype=torch.float64)
    mean, slowest = per_step.clone(), per_step.clone()
    dist.all_reduce(mean)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    mean /= dist.get_world_size()
    return {n: (float(m), float(s)) for n, m, s in zip(names, mean, slowest)}


def print_profiles(profiles: dict, width: int = 12) -> None:
    """One table: a row per stage that ran, a column per profiled arm (``{label: stage_profile(...)}``), ms
    per step as the mean over ranks; "other" is what no stage of its part covers."""
    labels = list(profiles)
    print("\nstage profile, ms per step (mean over ranks; the slowest rank's forward and backward in brackets):")
    for i, label in enumerate(labels):
        print(f"  [{i}] {label}")
    print(f"  {'stage':<34}" + "".join(f"{f'[{i}]':>{width}}" for i in range(len(labels))))
    for part, stages in (("forward", FORWARD), ("backward", BACKWARD)):
        totals = [profiles[label][part] for label in labels]
        print(f"  {part:<34}" + "".join(f"{f'{1e3 * m:.1f} ({1e3 * s:.0f})':>{width}}" for m, s in totals))
        ran = [n for n in stages if any(profiles[label][n][1] > 0 for label in labels)]
        for name in ran:
            print(f"    {name:<32}" + "".join(f"{1e3 * profiles[label][name][0]:>{width}.1f}" for label in labels))
        other = [profiles[label][part][0] - sum(profiles[label][n][0] for n in ran) for label in labels]
        print(f"    {'other':<32}" + "".join(f"{1e3 * o:>{width}.1f}" for o in other))
