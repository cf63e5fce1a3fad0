"""Experiment 4 table: tiny MoE LM throughput on the emulated 2-node cluster, with the cost model."""
from __future__ import annotations

import numpy as np

from experiments.step_model import calibrated_cost, moe_share, predicted_steps
from experiments.table_cells import runs_header
from placement.report import legend_below


def make(rows, out_dir) -> str:
    calib = [r for r in rows if "calibration" in r]
    runs = [r for r in rows if "step_s" in r]
    base = next(r for r in runs if r["router"] == "switch" and r["placement"] == "contiguous" and r["dedup"] == "none")
    cost = calibrated_cost(calib[-1])
    fit = calib[-1]["calibration"]
    lines = [f"{runs_header('throughput', runs, 'router', 'placement', 'dedup')} launch/emulate_cluster.sh: 2 "
             "network-namespace nodes x 2 ranks, inter-node link shaped to 400 mbit. "
             "The tiny LM of `configs/lm_branch.yaml` "
             f"(E=8, top-2, 2 MoE layers, d_model 64), 16 sequences x 64 bytes per rank, {base['steps']} steps, "
             "seed 0; step time is the trainer's `train_seconds` / steps (evaluation excluded). Links calibrated "
             "at the start of the launch: " + ", ".join(
                 f"{k} alpha {1e6 * v['alpha_s']:.0f} us, {v['bandwidth_Bps'] / 1e6:.0f} MB/s" for k, v in fit.items())
             + f", latency {1e3 * cost.latency_s:.1f} ms per collective. Predicted step "
             "(`experiments/step_model.py`): the baseline's compute (its step minus its measured all-to-alls) + "
             "this arm's calibrated exchanges (4 payload exchanges and the small collectives per MoE layer per step).",
             "", "| router | placement | dedup | step ms | tokens/s | throughput ratio | measured a2a ms/step | "
             "predicted step ms | predicted ratio | model error |", "|---|---|---|---|---|---|---|---|---|---|"]
    points = []
    predictions, summary = predicted_steps(runs, base, cost, moe_share(64, 128, 2, 8, 64, 2))
    for r, (pred_step, err) in zip(runs, predictions):
        lines.append(f"| {r['router']} | {r['placement']} | {r['dedup']} | {1e3 * r['step_s']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
                     f"{1e3 * r['measured_a2a_s']:.1f} | {1e3 * pred_step:.1f} | "
                     f"{base['step_s'] / pred_step:.2f}x | {100 * err:+.0f}% |")
        points.append((f"{r['router']}/{r['placement'][:5]}/{r['dedup']}", r["step_s"], pred_step))
    plot_throughput(points, out_dir / "throughput.png")
    lines += ["", "Ratios are throughput (tokens/s) over switch + contiguous + no dedup; the predicted ratio is "
              f"baseline step / predicted step. Model error: {summary}.", "",
              "![measured and predicted step times](results/throughput.png)"]
    return "\n".join(lines)


def plot_throughput(points, path) -> None:
    # matplotlib: optional and slow to import, only when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.8))
    x = np.arange(len(points))
    ax.bar(x - 0.2, [1e3 * p[1] for p in points], 0.4, label="measured")
    ax.bar(x + 0.2, [1e3 * p[2] for p in points], 0.4, label="cost model")
    ax.set_xticks(x, [p[0] for p in points], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("ms per training step")
    ax.set_title("tiny MoE LM, 2 emulated nodes x 2, 400 mbit inter-node link")
    legend_below(fig, [ax], 0.08)
    fig.savefig(path, dpi=110)
    plt.close(fig)
