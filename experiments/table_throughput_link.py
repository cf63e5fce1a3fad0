"""Experiment 4b table: the tiny LM where the link matters, each factor alone and all together."""
from __future__ import annotations

from experiments.plans import LINK_REGIMES, REGIME_NAMES
from experiments.step_model import calibrated_cost, moe_share, predicted_steps
from experiments.table_cells import runs_header
from experiments.table_throughput import plot_throughput

# multi-node MoE training reports, for the all-to-all's share of a step (cited in the table)
LITERATURE = ("FSMoE (Pan et al., ASPLOS 2025) profiles the communication of multi-node MoE training (all-to-all, "
              "all-gather / reduce-scatter, gradient all-reduce) at 30-60% of the time, more than half in many of its "
              "configurations; Lina (Li et al., USENIX ATC 2023) names the all-to-all the main cause of slow "
              "distributed MoE training")


def make(rows, out_dir) -> str:
    calib = [r for r in rows if "calibration" in r]
    cost = calibrated_cost(calib[-1])
    parts, points = [], []
    for regime in LINK_REGIMES:
        runs = [r for r in rows if "step_s" in r and r.get("regime", "today") == regime]  # older rows: today's
        if any(r["arm"] == "baseline" for r in runs):
            lines, regime_points = _regime_table(regime, runs, cost)
            parts.append(lines)
            points += regime_points
    plot_throughput(points, out_dir / "throughput_link.png")
    return "\n\n".join(parts) + ("\n\nRatios are tokens/s over each regime's baseline (switch + contiguous + no "
                                  f"dedup, C = 1). For the all-to-all's share in the literature: {LITERATURE}.\n\n"
                                  "![measured and predicted step times](results/throughput_link.png)")


def _regime_table(regime: str, runs: list, cost) -> tuple[str, list]:
    base = next(r for r in runs if r["arm"] == "baseline")
    model = LINK_REGIMES[regime][1]
    shape = {k.split("=")[0].split(".")[1]: int(k.split("=")[1]) for k in model}
    k, e = shape.get("top_k", 2), shape.get("num_experts", 8)
    share = moe_share(shape["d_model"], shape["ffn_hidden_size"], k, e, 64, 2)
    in_steps = all(r.get("exchange_wait_step_s") for r in runs)
    name = REGIME_NAMES.get(regime, regime)
    lines = [f"**{name}** regime. {runs_header('throughput_link', runs, 'arm')} The same emulated cluster and LM "
             f"as above at d_model {shape['d_model']}, SwiGLU ffn {shape['ffn_hidden_size']} (E={e}, top-{k}, 2 MoE "
             f"layers), 16 sequences x 64 bytes per rank, {base['steps']} steps. Measured all-to-all: each MoE "
             "layer's dispatch bytes for one batch replayed after training (4 exchanges per layer per step)"
             + ("; blocked in exchanges: the dispatcher's waits inside the training steps (mean over ranks)"
                if in_steps else "") + ". Predicted step (`experiments/step_model.py`): the baseline's compute (its "
             "step minus its exchange time), of which the MoE layers' matmul share "
             f"({100 * share:.0f}%) overlaps when pipelined, plus each arm's calibrated exchanges, priced from "
             + ("the bytes its training steps sent (`train_traffic.json`) "
                if all(r.get("priced_from") == "training steps" for r in runs) else "its validation routing ") +
             f"(`CostModel.layer_time`: node {cost.levels['node'].bandwidth_Bps / 1e6:.0f} MB/s shared, "
             f"latency {1e3 * cost.latency_s:.1f} ms per collective, overlap {cost.overlap:.2f}).", "",
             "| arm | router | dedup | C | step ms | tokens/s | ratio | measured a2a ms/step | a2a share | "
             + ("blocked in exchanges ms/step | " if in_steps else "") + "predicted step ms | model error |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if in_steps else "") + "---|---|"]
    points = []
    predictions, summary = predicted_steps(runs, base, cost, share)
    for r, (pred, err) in zip(runs, predictions):
        waits = f"{1e3 * r['exchange_wait_step_s']:.1f} | " if in_steps else ""
        lines.append(f"| {r['arm']} | {r['router']} | {r['dedup']} | {r['chunks']} | {1e3 * r['step_s']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
                     f"{1e3 * r['measured_a2a_s']:.1f} | {100 * r['measured_a2a_s'] / r['step_s']:.0f}% | "
                     f"{waits}{1e3 * pred:.1f} | {100 * err:+.0f}% |")
        points.append((f"{regime}:{r['arm']}", r["step_s"], pred))
    lines += ["", f"Model error ({name}): {summary}."]
    return "\n".join(lines), points
