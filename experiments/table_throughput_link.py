"""Experiment 4b table: the tiny LM where the link matters, each factor alone and all together."""
from __future__ import annotations

import statistics

from experiments.table_throughput import _plot
from experiments.tables import runs_header
from placement import CostModel

# multi-node MoE training reports, for the all-to-all's share of a step (cited in the table)
LITERATURE = ("FSMoE (Pan et al., ASPLOS 2025) profiles the communication of multi-node MoE training (all-to-all, "
              "all-gather / reduce-scatter, gradient all-reduce) at 30-60% of the time, more than half in many of its "
              "configurations; Lina (Li et al., USENIX ATC 2023) names the all-to-all the main cause of slow "
              "distributed MoE training")


def _moe_share(d: int, ffn: int, k: int, e: int, seq: int, layers: int, vocab: int = 256) -> float:
    """The MoE layers' share of a step's matmul work, from the model's shape (per token)."""
    attention = 4 * d * d + 2 * seq * d  # qkv and out projections; scores and values
    moe = k * 3 * d * ffn + d * e  # top-k SwiGLU experts; the router
    return layers * moe / (layers * (attention + moe) + vocab * d)


def _cost(calibration: dict, exchange: dict) -> CostModel:
    cost = CostModel.default(list(calibration)).updated(calibration)
    return cost.with_exchange(exchange.get("latency_s", 0.0), exchange.get("overlap", 0.0),
                              exchange.get("chunked", 1.0))


def make(rows, out_dir) -> str:
    calib = [r for r in rows if "calibration" in r]
    runs = [r for r in rows if "step_s" in r]
    base = next(r for r in runs if r["arm"] == "baseline")
    cost = _cost(calib[-1]["calibration"], calib[-1].get("exchange", {}))
    from experiments.plans import LINK_MODEL

    shape = {k.split("=")[0].split(".")[1]: int(k.split("=")[1]) for k in LINK_MODEL}
    share = _moe_share(shape["d_model"], shape["ffn_hidden_size"], 2, 8, 64, 2)
    compute = base["step_s"] - base["measured_a2a_s"]  # the baseline's step without its measured all-to-alls
    lines = [f"{runs_header('throughput_link', runs, 'arm')} The same emulated cluster and LM as above at "
             f"d_model {shape['d_model']}, SwiGLU ffn {shape['ffn_hidden_size']} (E=8, top-2, 2 MoE layers), "
             f"16 sequences x 64 bytes per rank, {base['steps']} steps. Measured all-to-all: each MoE layer's "
             "dispatch bytes for one batch replayed after training (4 exchanges per layer per step). "
             "Predicted step: the baseline's compute (its step minus its measured all-to-alls), of which the "
             f"MoE layers' matmul share ({100 * share:.0f}%) overlaps when pipelined, plus each arm's calibrated "
             f"exchanges (`CostModel.layer_time`: node {cost.levels['node'].bandwidth_Bps / 1e6:.0f} MB/s shared, "
             f"latency {1e3 * cost.latency_s:.1f} ms per collective, overlap {cost.overlap:.2f}).", "",
             "| arm | router | dedup | C | step ms | tokens/s | ratio | measured a2a ms/step | a2a share | "
             "predicted step ms | model error |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    points, errors = [], []
    moe = compute * share / len(base["predicted_stage_s"])
    for r in runs:
        layers = [cost.layer_time(stages, moe, r["chunks"])["layer_s"] for stages in r["predicted_stage_s"]]
        pred = compute * (1 - share) + sum(layers)
        err = (pred - r["step_s"]) / r["step_s"]
        errors.append(abs(err))
        lines.append(f"| {r['arm']} | {r['router']} | {r['dedup']} | {r['chunks']} | {1e3 * r['step_s']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
                     f"{1e3 * r['measured_a2a_s']:.1f} | {100 * r['measured_a2a_s'] / r['step_s']:.0f}% | "
                     f"{1e3 * pred:.1f} | {100 * err:+.0f}% |")
        points.append((r["arm"], r["step_s"], pred))
    _plot(points, out_dir / "throughput_link.png")
    lines += ["", f"Ratios are tokens/s over the baseline (switch + contiguous + no dedup, C = 1). Model error: "
              f"median {100 * statistics.median(errors):.0f}%, max {100 * max(errors):.0f}%. For the "
              f"all-to-all's share in the literature: {LITERATURE}.", "",
              "![measured and predicted step times](results/throughput_link.png)"]
    return "\n".join(lines)
