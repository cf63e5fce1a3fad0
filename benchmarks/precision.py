"""bf16 training (``train.precision: bf16``) against fp32 on the demo configs, side by side in one run.

For each config and seed, the same run twice, fp32 then bf16 (the order alternates by seed, so drift
on the machine hits both alike): its validation loss and its time in training steps. Printed per
config: each precision's mean validation loss and the seeds' standard deviation, the bf16 - fp32
difference of the means, and the median of the per-seed time ratios bf16 / fp32. "Within seed noise"
means |difference| <= the larger of the two standard deviations.

    .venv/bin/python benchmarks/precision.py [--seeds 3] [--steps 200] [--configs demo,lm_branch]

One process each (the LM config's expert parallelism is replaced by one rank: the precision, not the
exchange, is measured). On a CPU, bf16 speed depends on its bf16 instructions (avx512_bf16, AMX);
on a GPU run it with --device cuda.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_moe.train.config import load_config  # noqa: E402
from dist_moe.train.trainer import train  # noqa: E402

CONFIGS = {"demo": "configs/demo.yaml", "lm_branch": "configs/lm_branch.yaml"}
ROOT = Path(__file__).resolve().parents[1]


def run(config: str, precision: str, seed: int, steps: int, device: str, out: Path) -> dict:
    cfg = load_config(str(ROOT / CONFIGS[config]), [
        f"seed={seed}", f"train.precision={precision}", f"train.max_steps={steps}", f"parallel.device={device}",
        f"output.dir={out / f'{config}_{precision}_{seed}'}", "parallel.dedup=rank"])
    summary = train(cfg, quiet=True)
    return {"val_loss": summary["val_loss"], "seconds": summary["train_seconds"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs.split(","):
            results = {"fp32": [], "bf16": []}
            for seed in range(args.seeds):
                order = ("fp32", "bf16") if seed % 2 == 0 else ("bf16", "fp32")
                for precision in order:
                    results[precision].append(run(config, precision, seed, args.steps, args.device, Path(tmp)))
            print(table(config, results, args.steps))


def table(config: str, results: dict, steps: int) -> str:
    losses = {p: [r["val_loss"] for r in rs] for p, rs in results.items()}
    means = {p: statistics.fmean(v) for p, v in losses.items()}
    spread = {p: statistics.stdev(v) if len(v) > 1 else 0.0 for p, v in losses.items()}
    ratios = [b["seconds"] / f["seconds"] for f, b in zip(results["fp32"], results["bf16"])]
    diff = means["bf16"] - means["fp32"]
    verdict = "within" if abs(diff) <= max(spread.values()) else "OUTSIDE"
    return (f"{config} ({len(ratios)} seeds x {steps} steps): val loss fp32 {means['fp32']:.4f} +- "
            f"{spread['fp32']:.4f}, bf16 {means['bf16']:.4f} +- {spread['bf16']:.4f}, difference {diff:+.4f} "
            f"({verdict} seed noise); time bf16 / fp32 {statistics.median(ratios):.2f}x "
            f"(per seed {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
