"""Activations one MoE layer keeps for its backward, under train.precision fp32 and bf16, measured side by
side on CPU and against ``placement.activations``' estimate.

The fine-grained shape: hidden 512, expert ffn 128, 16 experts top-4, 2,048 tokens per rank; one process
(every expert local) and 2 gloo ranks (rank dedup, 1 and 3 chunks; no dedup). Measured: every tensor the
forward saves for backward, counted once per storage, less the layer's input (the previous layer keeps it)
and its weights and their bf16 copies (once per forward, weight-sized). bf16 is autocast, as the trainer
runs it: the layer's input arrives in fp32, as a LayerNorm's output does.

    .venv/bin/python benchmarks/activation_memory.py [--tokens 2048] [--hidden 512] [--ffn 128]

Goal: bf16 at most 0.55x fp32 on every path.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_moe import MoELayer  # noqa: E402
from placement import Topology  # noqa: E402
from placement.activations import activation_bytes  # noqa: E402
from placement.forecast import ModelShape  # noqa: E402
from tests.support.dist_utils import run_workers  # noqa: E402

GOAL = 0.55
PATHS = (("none", 1), ("rank", 1), ("rank", 3))  # on 2 ranks: (dedup, chunks)


def saved_bytes(layer: torch.nn.Module, x: torch.Tensor, bf16: bool) -> int:
    """Bytes of the tensors ``layer(x)`` saves for backward (see above), one forward and backward."""
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    weight_shapes = {tuple(p.shape) for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and tuple(t.shape) not in weight_shapes:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), torch.autograd.graph.saved_tensors_hooks(
            pack, lambda t: t):
        out = layer(x)
    (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
    return sum(seen.values())


def layer_of(args, dedup: str = "rank", chunks: int = 1, world: int = 1) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(args.hidden, args.ffn, {"type": "switch", "num_experts": args.experts, "top_k": args.top_k,
                                            "jitter_eps": 0.0}, capacity_factor=None,
                    group=dist.group.WORLD if world > 1 else None, topology=Topology(("node", "gpu"), (1, world)),
                    dedup=dedup, pipeline_chunks=chunks)


def measure(args, dedup: str = "rank", chunks: int = 1, world: int = 1) -> dict:
    """{fp32, bf16: bytes saved} on this rank, and whether it exchanged."""
    layer = layer_of(args, dedup, chunks, world)
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(dist.get_rank() if world > 1
                                                                                       else 0), requires_grad=True)
    out = {name: saved_bytes(layer, x, name == "bf16") for name in ("fp32", "bf16")}
    out["exchanged"] = world > 1
    return out


def estimate(args, compute: int, wire: int | None) -> int:
    shape = ModelShape(args.hidden, args.ffn, args.experts, args.top_k, args.tokens)
    return activation_bytes(shape, compute, wire)


def worker(rank, world, args, rows):
    for dedup, chunks in PATHS:
        m = measure(args, dedup, chunks, world)
        rows.append((rank, f"{world} ranks, dedup {dedup}, C={chunks}", m))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = [(0, "1 process", measure(args))]
    manager = torch.multiprocessing.Manager()
    shared = manager.list()
    run_workers(worker, 2, args=(args, shared), timeout=600)
    rows += sorted(shared, key=lambda r: (r[1], r[0]))
    print(f"{'path':<28}{'rank':>5}{'fp32 MiB':>10}{'bf16 MiB':>10}{'bf16/fp32':>11}{'estimate fp32':>15}"
          f"{'estimate bf16':>15}")
    worst = 0.0
    for rank, name, m in rows:
        ratio = m["bf16"] / m["fp32"]
        worst = max(worst, ratio)
        # the estimate's bound: every pair its own copy (dedup none; rank dedup receives fewer)
        est32, est16 = (estimate(args, b, b if m["exchanged"] else None) for b in (4, 2))
        print(f"{name:<28}{rank:>5}{m['fp32'] / 2**20:>10.2f}{m['bf16'] / 2**20:>10.2f}{ratio:>11.3f}"
              f"{est32 / 2**20:>15.2f}{est16 / 2**20:>15.2f}")
    print(f"bf16 / fp32 at most {worst:.3f} (goal <= {GOAL}): {'met' if worst <= GOAL else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
