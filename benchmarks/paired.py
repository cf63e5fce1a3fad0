"""Ratios of two timings that hold on a shared machine: the arms take turns repetition by repetition,
so drift and other jobs on the cores hit every arm alike; each ratio is of one repetition's pair, and
the median of those ratios is printed with the spread of its middle half."""
from __future__ import annotations

import statistics
from collections.abc import Callable

from placement.calibrate import slowest_once


def interleaved(arms: dict[str, Callable[[], object]], repeats: int, group=None) -> dict[str, list[float]]:
    """Per arm, ``repeats`` timings of its function (each the slowest rank's seconds), the arms taking
    turns in every repetition after one warm-up round. Every rank of ``group`` calls it with the same arms."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for rep in range(repeats + 1):
        for name, fn in arms.items():
            seconds = slowest_once(fn, group)
            if rep:
                times[name].append(seconds)
    return times


def paired_ratio(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """(median, first quartile, third quartile) of num[i] / den[i] over the paired repetitions."""
    if len(num) != len(den) or not num:
        raise ValueError(f"paired timings need the same number of repetitions, got {len(num)} and {len(den)}")
    ratios = [a / b for a, b in zip(num, den)]
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return median, q1, q3


def ratio_text(num: list[float], den: list[float]) -> str:
    """``1.12x (1.05-1.20, middle half of 15 paired repetitions)``"""
    median, q1, q3 = paired_ratio(num, den)
    return f"{median:.2f}x ({q1:.2f}-{q3:.2f}, middle half of {len(num)} paired repetitions)"
