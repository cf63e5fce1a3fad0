"""Experiment 4b table: the tiny LM where the link matters, each factor alone and all together."""
from __future__ import annotations

from experiments.table_throughput import _plot
from experiments.tables import runs_header
from experiments.step_model import calibrated_cost, moe_share, predicted_steps

# multi-node MoE training reports, for the all-to-all's share of a step (cited in the table)
LITERATURE = ("FSMoE (Pan et al., ASPLOS 2025) profiles the communication of multi-node MoE training (all-to-all, "
              "all-gather / reduce-scatter, gradient all-reduce) at 30-60% of the time, more than half in many of its "
              "configurations; Lina (Li et al., USENIX ATC 2023) names the all-to-all the main cause of slow "
              "distributed MoE training")


def make(rows, out_dir) -> str:
    calib = [r for r in rows if "calibration" in r]
    runs = [r for r in rows if "step_s" in r]
    base = next(r for r in runs if r["arm"] == "baseline")
    cost = calibrated_cost(calib[-1])
    from experiments.plans import LINK_MODEL

    shape = {k.split("=")[0].split(".")[1]: int(k.split("=")[1]) for k in LINK_MODEL}
    share = moe_share(shape["d_model"], shape["ffn_hidden_size"], 2, 8, 64, 2)
    lines = [f"{runs_header('throughput_link', runs, 'arm')} The same emulated cluster and LM as above at "
             f"d_model {shape['d_model']}, SwiGLU ffn {shape['ffn_hidden_size']} (E=8, top-2, 2 MoE layers), "
             f"16 sequences x 64 bytes per rank, {base['steps']} steps. Measured all-to-all: each MoE layer's "
             "dispatch bytes for one batch replayed after training (4 exchanges per layer per step). "
             "Predicted step (`experiments/step_model.py`): the baseline's compute (its step minus its measured "
             f"all-to-alls), of which the MoE layers' matmul share ({100 * share:.0f}%) overlaps when pipelined, "
             f"plus each arm's calibrated exchanges (`CostModel.layer_time`: node {cost.levels['node'].bandwidth_Bps / 1e6:.0f} MB/s shared, "
             f"latency {1e3 * cost.latency_s:.1f} ms per collective, overlap {cost.overlap:.2f}).", "",
             "| arm | router | dedup | C | step ms | tokens/s | ratio | measured a2a ms/step | a2a share | "
             "predicted step ms | model error |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    points = []
    predictions, summary = predicted_steps(runs, base, cost, share)
    for r, (pred, err) in zip(runs, predictions):
        lines.append(f"| {r['arm']} | {r['router']} | {r['dedup']} | {r['chunks']} | {1e3 * r['step_s']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
                     f"{1e3 * r['measured_a2a_s']:.1f} | {100 * r['measured_a2a_s'] / r['step_s']:.0f}% | "
                     f"{1e3 * pred:.1f} | {100 * err:+.0f}% |")
        points.append((r["arm"], r["step_s"], pred))
    _plot(points, out_dir / "throughput_link.png")
    lines += ["", f"Ratios are tokens/s over the baseline (switch + contiguous + no dedup, C = 1). Model error: "
              f"{summary}. For the "
              f"all-to-all's share in the literature: {LITERATURE}.", "",
              "![measured and predicted step times](results/throughput_link.png)"]
    return "\n".join(lines)
