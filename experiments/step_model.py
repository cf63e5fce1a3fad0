"""The throughput tables' step model: a training step predicted from calibrated links.

Compute (everything but exchanges) is the baseline arm's: its measured step minus its exchange
time (blocked in the dispatcher's waits inside its steps; for older rows its all-to-alls replayed
after training, ``measures.after_exchange_time``). The MoE layers' share of it, from the model's
shape (matmul work per token), is what a pipelined layer can overlap. Each arm adds its own
exchanges, priced from its recorded routing on the launch's calibrated links
(``CostModel.layer_time``: per-stage payloads, collective latencies, pipelined overlap).
"""
from __future__ import annotations

import statistics

from placement import CostModel


def moe_share(d: int, ffn: int, k: int, e: int, seq: int, layers: int, vocab: int = 256) -> float:
    """The MoE layers' share of a step's matmul work, from the model's shape (per token)."""
    attention = 4 * d * d + 2 * seq * d  # qkv and out projections; scores and values
    moe = k * 3 * d * ffn + d * e  # top-k SwiGLU experts; the router
    return layers * moe / (layers * (attention + moe) + vocab * d)


def calibrated_cost(row: dict) -> CostModel:
    """The cost model of a launch's calibration row (``measures.before_calibrate``)."""
    calibration, exchange = row["calibration"], row.get("exchange", {})
    cost = CostModel.default(list(calibration)).updated(calibration)
    return cost.with_exchange(exchange.get("latency_s", 0.0), exchange.get("overlap", 0.0),
                              exchange.get("chunked", 1.0))


def exchange_s(row: dict) -> float:
    """A run's exchange seconds per step: blocked in the dispatcher's waits inside its training
    steps (``exchange_wait_step_s``, logged by newer runs), else its dispatch replayed after training
    (``measured_a2a_s``, rows from before)."""
    return row["exchange_wait_step_s"] if row.get("exchange_wait_step_s") else row["measured_a2a_s"]


def predicted_steps(runs: list, base: dict, cost: CostModel, share: float) -> tuple[list, str]:
    """(predicted step seconds and signed relative error of each run, from its ``predicted_hop_s``
    per layer and ``chunks``; "median X%, max Y%" of the absolute errors)."""
    compute = base["step_s"] - exchange_s(base)
    moe = compute * share / len(base["predicted_hop_s"])
    out = []
    for r in runs:
        pred = compute * (1 - share) + sum(cost.layer_time(hops, moe, r.get("chunks", 1))["layer_s"]
                                           for hops in r["predicted_hop_s"])
        out.append((pred, (pred - r["step_s"]) / r["step_s"]))
    errors = [abs(e) for _, e in out]
    return out, f"median {100 * statistics.median(errors):.0f}%, max {100 * max(errors):.0f}%"
