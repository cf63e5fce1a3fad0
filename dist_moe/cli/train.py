"""`dist-moe train`: train a model from a YAML config and key=value overrides, then print its summary."""
from __future__ import annotations

import json
import os

from dist_moe.train.config import load_config
from dist_moe.train.trainer import train


def add_parser(sub, debug) -> None:
    tr = sub.add_parser("train", parents=[debug],
                        help="train a model; without --config, the embedded demo (BRANCH on keel magic)")
    tr.add_argument("--config", help="YAML config; keys missing from it keep the embedded defaults")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.add_argument("--json", action="store_true", help="print the summary as JSON")
    tr.add_argument("overrides", nargs="*",
                    help="key.sub=value overrides, e.g. router.type=switch train.epochs=2 (a new router type "
                         "keeps the keys it also takes, such as num_experts and top_k)")


def run(args, extra: list[str]) -> int:
    # key=value overrides may also follow an option (argparse stops the positional list there)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray:
        raise ValueError(f"unrecognized arguments: {' '.join(stray)} (see dist-moe --help)")
    cfg = load_config(args.config, [*args.overrides, *extra])
    summary = train(cfg, quiet=args.quiet)
    if os.environ.get("RANK", "0") != "0":  # under a launcher, rank 0 speaks for the run
        return 0
    if args.json:
        print(json.dumps(summary, indent=2, allow_nan=False))  # the trainer's json_safe summary: strict JSON
    else:
        print_summary(summary)
    return 0


def print_summary(s: dict) -> None:
    if s.get("exported_before"):  # a resumed run without checkpoints that had already trained and exported
        print(f"{s['name']}: the run in {s['output_dir']} had finished training (it keeps no checkpoints): its "
              f"trained model is in {s['hf_model']}; nothing left to train")
        return
    rp = s.get("random_pair_tree_distance")
    td = s.get("val_tree_distance")
    def num(key, scale=1.0, digits=4):  # a metric may be null (e.g. NaN after skipped steps)
        return "n/a" if s.get(key) is None else f"{scale * s[key]:.{digits}f}"

    own = f" ({s['num_experts']} experts, top-{s['top_k']}: the model's own router)" if "num_experts" in s else ""
    print(f"\n{s['name']}: router={s['router']}{own} steps={s['steps']} time={s['seconds']}s")
    if s.get("already_finished"):
        print(f"  the run in {s['output_dir']} had already finished at step {s['steps']}: nothing left to train "
              "(raise train.epochs or train.max_steps to train on); its checkpoint evaluates to:")
    if s.get("skipped_steps"):
        print(f"  skipped steps (non-finite loss or gradients): {s['skipped_steps']}")
    print(f"  validation loss {num('val_loss')}  accuracy {num('val_acc', 100, 2)}%")
    layers = sum(k.startswith("val_layer") and k.endswith("_load_cv") for k in s)
    if layers > 1:  # evaluate's layers_metrics: the mean at the top, each layer's as val_layer<i>_<key>
        print(f"  validation routing, mean over the {layers} MoE layers (each layer's: val_layer<i>_* in "
              f"{s['output_dir']}/summary.json):")
    print(f"  load CV {num('val_load_cv', 1, 3)}  dropped {num('val_dropped_fraction', 100, 2)}% of slots")
    if td is not None and rp:  # None with top-1 routing: no co-selected pairs
        closer = 100 * (1 - td / rp)
        side = f"{closer:.1f}% closer than random pairs" if closer >= 0 else f"{-closer:.1f}% farther than random pairs"
        print(f"  tree distance {td:.3f} (random pairs {rp:.3f}: co-selected experts {side})")
    if s.get("val_node_share"):
        print(f"  node share {' / '.join(f'{v:.3f}' for v in s['val_node_share'])} "
              f"(their CV {num('val_node_share_cv', 1, 3)}): each node's share of the router's validation load, "
              "before capacity drops (dist-moe report: of the slots dispatched after them)")
    if s.get("val_busiest_rank") is not None:
        print(f"  busiest rank {s['val_busiest_rank']:.2f}x the mean rank's routed slots (validation, before drops)")
    if s.get("val_align") is not None:
        print(f"  Align {s['val_align']:.3f} (share of categories hurt most by ablating their own expert)")
    print(f"  metrics: {s['output_dir']}/metrics.jsonl")
