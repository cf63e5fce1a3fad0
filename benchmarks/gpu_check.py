"""Every check that needs a GPU, in one prepared script for one GPU (an H200 when one is lent).

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--out DIR] [--throughput]   # a GPU image's python3, with its torch
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_check.py --cpu   # the same checks, CUDA mapped to the CPU

It runs on the GPU machine's image as it is (its own CUDA build of torch, no pip install); checks
that need DeepSpeed or Megatron-core there skip with a line saying so. It makes its own data. It
does not stop at a failed check: each prints one PASS, FAIL (with its error line) or SKIP (with the
reason) line, then a summary; ``--out`` also writes gpu_check.json. Budget: a few minutes.

1. ep sync: ``MoELayer``'s expert-parallel path on one NCCL rank (the dispatcher, the agreement
   header, categories as copy metadata, the shared expert beside the pipeline, capacity 1.25 for
   switch) for every router x dedup none/rank/node x 1 and 4 chunks, warmed up, then one forward and
   one backward under ``torch.cuda.set_sync_debug_mode("error")``: every synchronising CUDA call
   raises, except the dispatcher's split-size read (``all_to_all.read_to_host``, bracketed), which
   must happen exactly once per exchange in forward (node dedup 2) and never in backward.
2. ep == CPU fp32: the same runs' outputs, input gradients and every parameter gradient (router,
   experts, shared expert) against the local layer on the CPU with the same weights, within 1e-4
   of the largest magnitude.
3. ep == CPU bf16: the same in bf16 (a module cast; routing math stays fp32), within 2e-2.
4. cuda rng: a checkpoint saves this GPU's random stream and resume restores it bit for bit.
5. device: ``parallel.device=cuda`` takes ``cuda:LOCAL_RANK`` (every visible GPU), refuses a
   LOCAL_RANK past them, and makes that GPU the current device.
6. train step sync: one whole trainer step (screen, forward through the EP dispatcher with 2 chunks,
   backward, the overlapped gradient sum, clip, fused Adam with its device-side skip) under the same
   "error" mode: one read (the exchange's) and nothing else.
7. experts: the grouped GEMM against the per-expert loop (8 experts, hidden 512, ffn 128), fp32 and
   bf16: equal within the tolerances below, and the time of each.
8-10. train: ``dist-moe train`` (the tiny LM, BRANCH routing) on one NCCL rank with each engine;
   engine torch also in bf16 beside fp32, and twice with ``train.deterministic=true``, every logged
   loss equal bit for bit.
``--throughput`` adds tokens/s of the layer, dispatched and pipelined, against Megatron-core's.

``--cpu``: the device is the CPU and the rank a gloo one; "every synchronising call raises" is
the aten-level count of ``tests/support/sync_budget.py`` (reads and tensors built from Python data, the
ops that block on CUDA), and the comparisons are with the CPU's local layer. Checks 4 and 5 need
a GPU; ``tests/train/test_device.py`` covers them on the CPU with the CUDA calls faked.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

try:
    import numpy as np
    import torch
    import torch.distributed as dist
except ModuleNotFoundError as missing:  # e.g. a system python3 beside the project's .venv: say which to run instead
    sys.stderr.write(f"gpu_check.py: {missing.name} is not installed for {sys.executable}: run it with a Python that "
                     "has torch (here .venv/bin/python; on a GPU machine, its image's own python3), "
                     "or benchmarks/gpu_check.sh to install one\n")
    sys.exit(2)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (the shared EP checks) beside the packages

from dist_moe import MoELayer
from dist_moe.data.corpus import cache_path
from dist_moe.data.paths import save_cache
from dist_moe.data.sources import stdlib_code
from dist_moe.dispatch.all_to_all import HOST_READS
from dist_moe.dispatch.dispatcher import ExpertParallelDispatcher
from dist_moe.distributed.device_choice import own_gpu
from dist_moe.distributed.process_group import init_from_env, resolve_device
from dist_moe.optional_engines import engine_import
from dist_moe.train.checkpoint.state import DataCursor, restore_state, save_state
from tests.support.ep_checks import ROUTERS
from tests.support.sync_budget import counting

ROOT = Path(__file__).resolve().parents[1]
RESULTS: list[dict] = []
H, F, T = 16, 32, 96  # layer shape and tokens of the EP runs
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def check(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            start = time.time()
            try:
                detail = fn(*args, **kwargs)
                status = "SKIP" if isinstance(detail, str) and detail.startswith("skip:") else "PASS"
            except Exception as e:  # noqa: BLE001 - one failed check must not hide the others
                status, detail = "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
                traceback.print_exc()
            row = {"check": name, "status": status, "detail": detail, "seconds": round(time.time() - start, 1)}
            RESULTS.append(row)
            print(f"[{status}] {name}: {detail} ({row['seconds']} s)", flush=True)
        return run
    return wrap


# --- the expert-parallel layer on one rank -------------------------------------------------------
def _one_rank_group(device: torch.device):
    """WORLD as a group of one: NCCL on the GPU, gloo in --cpu mode."""
    if not dist.is_initialized():
        if device.type == "cuda":
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29661")
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
        else:
            store = Path(tempfile.mkdtemp(prefix="gpu-check-")) / "store"
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return dist.group.WORLD


@contextlib.contextmanager
def no_sync_allowed(device: torch.device):
    """Every synchronising call inside fails the check, except the dispatcher's bracketed split-size
    reads, which are counted: yields a namespace whose ``reads`` and ``other`` (unbracketed stalls,
    CPU mode; on CUDA they raise at once) are filled in on exit."""
    seen = SimpleNamespace(reads=0, other=[])
    before = HOST_READS[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode(0)
    else:
        with counting() as counter:
            yield seen
        seen.other = [w for w in counter.where() if not w.endswith("(read_to_host)")]
    seen.reads = HOST_READS[0] - before


def _inputs(cfg: dict, device, dtype) -> tuple:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    extra = {}
    if cfg["type"] == "specdrop":
        extra["categories"] = torch.randint(0, 5, (T,), generator=g)
    if cfg["type"] == "hash":
        extra["token_ids"] = torch.arange(T) * 7919
    return x.to(device, dtype), w.to(device), {k: v.to(device) for k, v in extra.items()}


def _step(layer, x, w, extra):
    """One forward and backward; returns (output, input gradient) and leaves parameter gradients."""
    x = x.detach().clone().requires_grad_()
    y, aux = layer(x, **extra)
    ((y.float() * w).sum() + aux).backward()
    return y, x.grad


def _relative(a, b) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0


def ep_run(name: str, cfg: dict, dedup: str, chunks: int, device, dtype, group) -> dict:
    """The EP layer on ``device`` against the local layer on the CPU (same weights, same two steps).
    A run that raises (on CUDA: a synchronising call under the "error" mode) is recorded with the
    error and where it came from, and the other runs go on."""
    row = {"run": f"{name} {dedup} C={chunks}", "exchanges": 2 if dedup == "node" else 1, "reads": None,
           "other": [], "worst": {}}
    try:
        _ep_run(row, cfg, dedup, chunks, device, dtype, group)
    except Exception as e:  # noqa: BLE001 - reported as this run's failure, with its place
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/dist_moe/" in f.filename
                  or "/placement/" in f.filename]
        at = f" at {Path(frames[-1].filename).relative_to(ROOT)}:{frames[-1].lineno}" if frames else ""
        row["other"].append(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}{at}")
    return row


def _ep_run(row: dict, cfg: dict, dedup: str, chunks: int, device, dtype, group) -> None:
    kwargs = dict(shared_expert_hidden=6, capacity_factor=1.25 if cfg["type"] == "switch" and "node_limit" not in cfg
                  else None, pipeline_chunks=chunks, dedup=dedup)
    torch.manual_seed(0)
    ref = MoELayer(H, F, dict(cfg), **kwargs)
    ep = MoELayer(H, F, dict(cfg), **kwargs)
    ep.load_state_dict(ref.state_dict())
    ref.to(dtype)
    ep.to(device).to(dtype)
    # One GPU holds one NCCL rank, and a layer on a group of one runs locally: the dispatcher is
    # attached by hand, so the expert-parallel path runs over the one-rank group.
    ep.dispatcher = ExpertParallelDispatcher(group, ep.placement, ep.topology, dedup)
    if dedup == "node":  # one node runs node dedup as rank dedup: its second hop is forced, so it runs too
        ep.dispatcher.dedup, ep.dispatcher.node_group = "node", group
    if cfg.get("variant") == "bernoulli":  # its training masks are random draws, which differ per device
        ref.eval(), ep.eval()
    x, w, extra = _inputs(cfg, device, dtype)
    x_cpu, w_cpu, extra_cpu = x.cpu(), w.cpu(), {k: v.cpu() for k, v in extra.items()}
    for layer, args in ((ref, (x_cpu, w_cpu, extra_cpu)), (ep, (x, w, extra))):
        _step(layer, *args)  # warm-up: one-time moves of index tables; router state moves once
        layer.zero_grad()
    want_y, want_gx = _step(ref, x_cpu, w_cpu, extra_cpu)
    x = x.detach().clone().requires_grad_()
    with no_sync_allowed(x.device) as fwd:
        y, aux = ep(x, **extra)
    with no_sync_allowed(x.device) as bwd:
        ((y.float() * w).sum() + aux).backward()
    row["reads"], row["other"] = (fwd.reads, bwd.reads), fwd.other + bwd.other
    row["worst"] = {"output": _relative(y, want_y), "input grad": _relative(x.grad, want_gx)}
    mine = dict(ep.named_parameters())
    for pname, p in ref.named_parameters():
        if p.grad is not None:
            got = mine[pname].grad
            row["worst"][f"grad {pname}"] = float("inf") if got is None else _relative(got, p.grad)


_RUNS: dict = {}  # dtype -> the runs, made once for the checks that read them


def ep_runs(device, dtype) -> list[dict]:
    if dtype not in _RUNS:
        group = _one_rank_group(device)
        _RUNS[dtype] = [ep_run(name, cfg, dedup, chunks, device, dtype, group) for name, cfg in ROUTERS.items()
                        for dedup in ("none", "rank", "node") for chunks in (1, 4)]
    return _RUNS[dtype]


@check("ep sync: EP layer on one rank, every router x dedup x chunks 1/4: no sync but 1 read per exchange")
def ep_sync(device):
    runs = ep_runs(device, torch.float32)
    bad = [f"{r['run']}: {'; '.join(r['other'][:2])}" for r in runs if r["other"]]
    bad += [f"{r['run']}: {r['reads'][0]} split-size reads in forward (want {r['exchanges']}), "
            f"{r['reads'][1]} in backward (want 0)" for r in runs if r["reads"] not in (None, (r["exchanges"], 0))]
    assert not bad, f"{len(bad)} of {len(runs)} runs: " + " | ".join(bad[:4])
    return f"{len(runs)} runs: forward reads = exchanges, backward 0, nothing else synchronised"


def _match(runs: list[dict], dtype) -> str:
    tol = TOLERANCE[dtype]
    failed = [r for r in runs if not r["worst"]]
    assert not failed, f"{len(failed)} runs did not complete, e.g. {failed[0]['run']}: {failed[0]['other'][:1]}"
    worst = max((v, r["run"], k) for r in runs for k, v in r["worst"].items())
    bad = [(r["run"], k, v) for r in runs for k, v in r["worst"].items() if not v <= tol]
    assert not bad, f"{len(bad)} values over {tol:g}, e.g. {bad[0][0]} {bad[0][1]}: {bad[0][2]:.2e}"
    return f"{len(runs)} runs; worst {worst[0]:.2e} ({worst[1]}, {worst[2]})"


@check("ep == CPU fp32: outputs, input and parameter gradients within 1e-4")
def ep_fp32(device):
    return _match(ep_runs(device, torch.float32), torch.float32)


@check("ep == CPU bf16: outputs, input and parameter gradients within 2e-2")
def ep_bf16(device):
    return _match(ep_runs(device, torch.bfloat16), torch.bfloat16)


# --- random streams and the device of a rank --------------------------------------------------------
@check("cuda rng: a checkpoint restores this GPU's random stream bit for bit")
def cuda_rng(device):
    if device.type != "cuda":
        return "skip: needs a GPU (tests/train/test_device.py covers save and restore with the CUDA calls faked)"

    rt = SimpleNamespace(device=device, world=1, rank=0, group=None)
    model = torch.nn.Linear(3, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.cuda.manual_seed(1234)
    torch.rand(7, device=device)  # a stream somewhere past its seed
    state = torch.cuda.get_rng_state(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_state(Path(tmp) / "ckpt", 3, model, opt, DataCursor(10, 0, 5), rt)
        want = torch.rand(1000, device=device)
        torch.rand(12345, device=device)  # training went on
        restore_state(path, model, opt, DataCursor(10, 0, 5), rt)
        restored = torch.cuda.get_rng_state(device)
        got = torch.rand(1000, device=device)
    assert torch.equal(restored, state), "the restored generator state differs from the saved one"
    assert torch.equal(got, want), "draws after resume differ from the draws after save"
    return f"state of {state.numel()} bytes restored; the next 1000 draws equal"


@check("device: parallel.device=cuda takes cuda:LOCAL_RANK and makes it current")
def device_choice(device):
    if device.type != "cuda":
        return "skip: needs a GPU (tests/train/test_device.py covers LOCAL_RANK with the device count faked)"

    count, saved = torch.cuda.device_count(), os.environ.get("LOCAL_RANK")
    try:
        for local in range(count):
            os.environ["LOCAL_RANK"] = str(local)
            chosen = resolve_device("cuda")
            assert chosen == torch.device("cuda", local) == resolve_device("auto"), chosen
            init_from_env(device=chosen)
            assert torch.cuda.current_device() == local, torch.cuda.current_device()
        os.environ["LOCAL_RANK"] = str(count)
        if count == 1 and own_gpu():  # a scheduler isolated this GPU: every LOCAL_RANK takes it, as cuda:0
            assert resolve_device("cuda") == torch.device("cuda", 0)
            return f"1 GPU of this task's own (CUDA_VISIBLE_DEVICES): LOCAL_RANK 0 and {count} -> cuda:0, current"
        try:
            resolve_device("cuda")
        except ValueError:
            pass
        else:
            raise AssertionError(f"LOCAL_RANK={count} with {count} GPUs was not refused")
    finally:
        os.environ.pop("LOCAL_RANK") if saved is None else os.environ.__setitem__("LOCAL_RANK", saved)
        torch.cuda.set_device(device)
    return f"{count} GPU(s): LOCAL_RANK i -> cuda:i, current; LOCAL_RANK={count} refused"


# --- training ---------------------------------------------------------------------------------
LM = ["--config", "configs/lm_branch.yaml", "data.seq_len=32", "data.per_domain=150", "train.max_steps=20",
      "train.log_every=5"]


def make_data(folder: Path) -> Path:
    """The LM corpus cache ``load_corpus`` reads, cut from Python's standard library sources (on every
    machine): four "domains" are four stretches of it, so no Debian data package is needed."""

    os.environ["DIST_MOE_DATA"] = str(folder)
    data = np.frombuffer(stdlib_code(2_000_000).encode("utf-8", errors="replace"), dtype=np.uint8)
    rows = data[: len(data) // 33 * 33].reshape(-1, 33)[:600]
    save_cache(cache_path(32, 150, 0), tokens=rows, domain=np.repeat(np.arange(4), 150))
    return folder


def _train(engine: str, device, data: Path, extra=(), tag: str = "") -> str:
    out = data.parent / f"run_{engine}{'_' + tag if tag else ''}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
           "dist_moe.cli", "train", "--quiet", "--json", *LM, f"engine={engine}", f"parallel.device={device.type}",
           f"output.dir={out}", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DIST_MOE_DATA": str(data)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    if r.returncode != 0:
        lines = [line for line in r.stderr.splitlines() if line.startswith("dist-moe: error")]
        raise RuntimeError((lines or r.stderr.strip().splitlines() or ["no output"])[-1])
    s = json.loads(r.stdout[r.stdout.index("{"):])
    return f"{s['steps']} steps, val loss {s['val_loss']:.4f}, {s['train_seconds']:.1f} s"


def _train_if_installed(engine: str, module: str, package: str, device, data: Path) -> str:
    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        return f"skip: {package} is not installed on this machine"
    return _train(engine, device, data)


@check("train: dist-moe train, engine torch, one rank")
def train_torch(device, data):
    return _train("torch", device, data)


@check("train: dist-moe train, engine deepspeed, one rank")
def train_deepspeed(device, data):
    return _train_if_installed("deepspeed", "deepspeed", "deepspeed", device, data)


@check("train: dist-moe train, engine megatron, one rank")
def train_megatron(device, data):
    return _train_if_installed("megatron", "megatron.core", "megatron-core", device, data)


class _Net(torch.nn.Module):
    """The trainer's model contract, (x, categories) -> (logits, aux): one MoE layer and a head."""

    def __init__(self, layer):
        super().__init__()
        self.moe, self.head = layer, torch.nn.Linear(H, 3)

    def forward(self, x, categories=None):
        y, aux = self.moe(x)
        return self.head(y), aux


@check("train step sync: one trainer step through the EP dispatcher, fp32 and bf16, no sync but its exchange's read")
def train_step_sync(device):
    return "; ".join(_train_step_sync(device, precision) for precision in ("fp32", "bf16"))


def _train_step_sync(device, precision: str) -> str:
    from dist_moe.train.precision import compute_context
    from dist_moe.train.step.steppers import LocalStepper
    from dist_moe.train.step.training_step import PlainStep
    from dist_moe.train.trainer import screened

    group = _one_rank_group(device)
    torch.manual_seed(0)
    layer = MoELayer(H, F, {"type": "branch", "num_experts": 8, "top_k": 2}, pipeline_chunks=2)
    layer.dispatcher = ExpertParallelDispatcher(group, layer.placement, layer.topology, "rank")
    model = _Net(layer).to(device)
    stepper = LocalStepper(model, 1e-3, 1.0, group, 1)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(T, H, generator=g), torch.randint(0, 3, (T,), generator=g)) for _ in range(3)]
    if device.type == "cuda":  # as the trainer copies them: from pinned memory, without blocking
        batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
    step, records = PlainStep(), []
    for i, (x, y) in enumerate(batches):
        xb, yb = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        compute = compute_context(device, precision)
        if i == 0:  # warm-up: optimizer state, index tables
            step(model, stepper, *screened(xb)[:1], yb, None, bad_input=screened(xb)[1], compute=compute)
            continue
        with no_sync_allowed(device) as seen:
            xb, bad = screened(xb)
            records.append(step(model, stepper, xb, yb, None, bad_input=bad, compute=compute))
        assert not seen.other, f"{precision}: synchronised outside the exchange: {seen.other[:3]}"
        assert seen.reads == 1, f"{precision}: {seen.reads} split-size reads in one step (one exchange: want 1)"
    losses = [round(float(r["loss"]), 4) for r in records]  # read after the checked steps
    assert all(np.isfinite(losses)) and not any(float(r["skipped"]) for r in records), records
    return f"{precision}: 2 steps (forward, backward, overlapped gradient sum, clip, fused Adam), 1 read each, " \
           f"losses {losses}"


def _experts_pass(experts, x, counts, grad, dtype, grouped: bool) -> list:
    """[output, input gradient, every weight's gradient (zeros where none)] of one forward and backward,
    grouped GEMMs or the per-expert loop, under bf16 autocast for ``dtype`` bf16."""
    xi = x.detach().clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        y = experts(xi, counts) if grouped else experts._looped_forward(xi, counts.tolist(), None)
    y.float().backward(grad)
    grads = [xi.grad] + [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in experts.parameters()]
    experts.zero_grad(set_to_none=True)
    return [y.detach()] + grads


@check("experts: grouped GEMM vs per-expert loop, fp32 and bf16 (equality and time)")
def grouped_vs_loop(device):
    from dist_moe.moe.experts import Experts

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        experts = Experts(8, 512, 128).to(device)
        counts = torch.tensor([700, 300, 0, 512, 1200, 64, 900, 420], device=device)
        x = torch.randn(int(counts.sum()), 512, device=device)
        grad = torch.randn_like(x)

        def run(grouped, experts=experts, counts=counts, x=x, grad=grad, dtype=dtype):
            return _experts_pass(experts, x, counts, grad, dtype, grouped)

        worst = max(_relative(a, b) for a, b in zip(run(True), run(False)))
        assert worst <= TOLERANCE[dtype], f"{dtype}: grouped vs loop differ by {worst:.2e}"
        seconds = {}
        for grouped in (False, True):
            for _ in range(3):
                run(grouped)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                run(grouped)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds[grouped] = (time.perf_counter() - start) / 10
        out.append(f"{str(dtype)[6:]}: worst {worst:.1e}, grouped {seconds[True] * 1e3:.2f} ms = "
                   f"{seconds[True] / seconds[False]:.2f}x the loop")
    return "; ".join(out)


@check("train bf16 vs fp32: dist-moe train, engine torch, train.precision bf16 against fp32")
def train_bf16(device, data):
    fp32 = _train("torch", device, data, extra=["train.precision=fp32"], tag="fp32")
    bf16 = _train("torch", device, data, extra=["train.precision=bf16"], tag="bf16")
    return f"fp32 {fp32}; bf16 {bf16}"


@check("deterministic: train.deterministic=true twice, every logged loss bit for bit")
def train_deterministic(device, data):
    runs = []
    for i in range(2):
        _train("torch", device, data, extra=["train.deterministic=true", "train.log_every=1"], tag=f"det{i}")
        lines = (data.parent / f"run_torch_det{i}" / "metrics.jsonl").read_text().splitlines()
        runs.append([json.loads(line).get("loss") for line in lines])
    differ = [i for i, (a, b) in enumerate(zip(*runs)) if a != b]
    assert runs[0] == runs[1], f"the two runs differ first at logged line {differ[:1]}"
    return f"{len(runs[0])} logged lines equal, last loss {[v for v in runs[0] if v is not None][-1]!r}"


# --- host stalls, memory and bytes the CPU predicts ------------------------------------------------
@contextlib.contextmanager
def counted_syncs(device: torch.device):
    """Yields a namespace whose ``count`` (synchronising calls) and ``where`` are filled in on exit: on CUDA
    every call ``set_sync_debug_mode("warn")`` reports, on the CPU the aten-level count."""
    seen = SimpleNamespace(count=0, where=[])
    if device.type == "cuda":
        import warnings

        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield seen
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        seen.count, seen.where = len(syncs), [f"{Path(w.filename).name}:{w.lineno}" for w in syncs]
    else:
        with counting() as counter:
            yield seen
        seen.count, seen.where = counter.total, counter.where()


@check("local sync: the local path's host reads as its experts' path predicts (grouped GEMM 0, loop 1), fp32 and bf16")
def local_sync(device):
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        layer = MoELayer(64, 128, {"type": "branch", "num_experts": 8, "top_k": 2}).to(device)
        x = torch.randn(256, 64, device=device, requires_grad=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            predicted = 0 if layer.experts.grouped(x) else 1  # the loop reads its counts once
            y, aux = layer(x)  # warm-up
            (y.float().sum() + aux).backward()
            with counted_syncs(device) as fwd:
                y, aux = layer(x)
        with counted_syncs(device) as bwd:
            (y.float().sum() + aux).backward()
        assert (fwd.count, bwd.count) == (predicted, 0), \
            f"{dtype}: {fwd.count} in forward (predicted {predicted}), {bwd.count} in backward: {fwd.where + bwd.where}"
        out.append(f"{str(dtype)[6:]} {'grouped' if predicted == 0 else 'loop'}: {fwd.count} / 0")
    return "forward / backward syncs: " + ", ".join(out)


@check("grouped GEMM edges: empty groups and a zero-row chunk, every gradient equal to the loop's")
def grouped_edges(device):
    from dist_moe.moe.experts import Experts

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for counts in ([5, 0, 7, 0], [0, 0, 0, 0]):
            torch.manual_seed(0)
            experts = Experts(4, 64, 32).to(device)
            c = torch.tensor(counts, device=device)
            x = torch.randn(sum(counts), 64, device=device)
            grad = torch.randn_like(x)

            got, want = (_experts_pass(experts, x, c, grad, dtype, grouped) for grouped in (True, False))
            worst = max(_relative(a, b) for a, b in zip(got, want))
            assert worst <= TOLERANCE[dtype], f"{dtype}, counts {counts}: grouped vs loop differ by {worst:.2e}"
            assert all(torch.isfinite(g).all() for g in got), f"{dtype}, counts {counts}: non-finite gradients"
            out.append(f"{str(dtype)[6:]} {counts}: {worst:.1e}")
    return "; ".join(out)


@check("activation memory: one MoE layer's kept activations against placement.activations' estimate")
def activation_memory(device):
    from benchmarks.activation_memory import saved_bytes
    from placement.activations import activation_bytes
    from placement.forecast import ModelShape

    t, h, f, e, k = 2048, 512, 128, 16, 4
    out = []
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        torch.manual_seed(0)
        layer = MoELayer(h, f, {"type": "switch", "num_experts": e, "top_k": k, "jitter_eps": 0.0},
                         capacity_factor=None).to(device)
        x = torch.randn(t, h, device=device, requires_grad=True)
        estimate = activation_bytes(ModelShape(h, f, e, k, t), size)
        if device.type == "cuda":  # what the forward leaves allocated until backward, less its output
            saved_bytes(layer, x, dtype == torch.bfloat16)  # warm-up
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                y, aux = layer(x)
            kept = torch.cuda.memory_allocated(device) - before - y.numel() * y.element_size()
            (y.float().sum() + aux).backward()
        else:
            kept = saved_bytes(layer, x, dtype == torch.bfloat16)
        ratio = kept / estimate
        assert 0.8 <= ratio <= 1.5, f"{dtype}: kept {kept / 2**20:.1f} MiB, estimate {estimate / 2**20:.1f} MiB"
        out.append(f"{str(dtype)[6:]} {kept / 2**20:.1f} MiB = {ratio:.2f}x the estimate")
    return "; ".join(out)


@check("wire bytes: an exchange's payload under bf16 autocast is half the fp32 run's (wire_dtype auto)")
def wire_bytes(device):
    group = _one_rank_group(device)
    sent = {}
    original = dist.all_to_all_single
    for name, bf16 in (("fp32", False), ("bf16", True)):
        torch.manual_seed(0)
        layer = MoELayer(H, F, {"type": "switch", "num_experts": 8, "top_k": 2, "jitter_eps": 0.0},
                         capacity_factor=None, pipeline_chunks=2).to(device)
        layer.dispatcher = ExpertParallelDispatcher(group, layer.placement, layer.topology, "rank")
        floats = [0]

        def counted(out, inp, *args, floats=floats, **kwargs):
            if inp.is_floating_point() and inp.dim() == 2 and inp.shape[1] == H:  # token rows, not gates
                floats[0] += inp.numel() * inp.element_size()
            return original(out, inp, *args, **kwargs)

        dist.all_to_all_single = counted
        try:
            x = torch.randn(T, H, device=device, requires_grad=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                y, aux = layer(x)
            (y.float().sum() + aux).backward()
        finally:
            dist.all_to_all_single = original
        sent[name] = floats[0]
    assert sent["fp32"] > 0 and 2 * sent["bf16"] == sent["fp32"], sent
    return f"rows both ways, forward and backward: fp32 {sent['fp32']:,} B, bf16 {sent['bf16']:,} B (0.50x)"


def _two_rank_worker(rank: int, world: int, device_type: str, store: str, out: str) -> None:
    """One rank of the multi-rank check, joining its group (NCCL on its GPU, gloo on the CPU)."""
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    try:
        worst = ranks_equal_one_process(rank, world, device)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}").write_text(f"{worst:.2e}")


def ranks_equal_one_process(rank: int, world: int, device: torch.device) -> float:
    """The EP layer on this rank's share of the tokens against one process holding every expert on all of
    them (the same weights), for rank and node dedup, 1 and 3 chunks: the worst relative difference."""
    from placement import Topology

    worst = 0.0
    for dedup, chunks in (("rank", 1), ("rank", 3), ("node", 1), ("node", 3)):
        torch.manual_seed(0)
        cfg = {"type": "switch", "num_experts": 8, "top_k": 2, "jitter_eps": 0.0}
        ref = MoELayer(H, F, dict(cfg), capacity_factor=None).to(device)
        ep = MoELayer(H, F, dict(cfg), capacity_factor=None, group=dist.group.WORLD, dedup=dedup,
                      pipeline_chunks=chunks, topology=Topology(("node", "gpu"), (2, world // 2))).to(device)
        ep.router.load_state_dict(ref.router.state_dict())
        for name, p in ep.experts.named_parameters():
            p.data.copy_(getattr(ref.experts, name).data[ep.local_expert_ids])
        g = torch.Generator().manual_seed(1)
        x_all, w_all = (torch.randn(world * T, H, generator=g).to(device) for _ in range(2))
        mine = slice(rank * T, (rank + 1) * T)
        x_ref = x_all.clone().requires_grad_()
        (ref(x_ref)[0] * w_all).sum().backward()
        x = x_all[mine].clone().requires_grad_()
        y, _ = ep(x)
        (y * w_all[mine]).sum().backward()
        pairs = [(y, ref(x_all)[0][mine]), (x.grad, x_ref.grad[mine])]
        pairs += [(p.grad, getattr(ref.experts, n).grad[ep.local_expert_ids])
                  for n, p in ep.experts.named_parameters()]
        for a, b in pairs:
            worst = max(worst, _relative(a, b))
    assert worst <= TOLERANCE[torch.float32], f"rank {rank}: worst {worst:.2e}"
    return worst


@check("ep ranks: expert parallelism over 2 or 4 GPUs (NCCL; rank and node dedup, 1 and 3 chunks) equals one process")
def ep_two_ranks(device):
    count = torch.cuda.device_count() if device.type == "cuda" else 2
    if count < 2:
        return f"skip: {count} GPU visible (needs 2; 4 run node dedup's second hop as 2 nodes x 2)"
    world = 4 if count >= 4 else 2
    with tempfile.TemporaryDirectory(prefix="gpu-check-ranks-") as tmp:
        torch.multiprocessing.spawn(_two_rank_worker, args=(world, device.type, f"{tmp}/store", tmp), nprocs=world)
        worst = [Path(tmp, f"rank{r}").read_text() for r in range(world)]
    return (f"{world} ranks as 2 nodes x {world // 2}: outputs, input and expert gradients on every rank; "
            f"worst {max(worst, key=float)}")


# --- throughput (optional) --------------------------------------------------------------------
def _tokens_per_s(step, tokens: int, repeats: int = 10) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    return tokens * repeats / (time.perf_counter() - start)


@check("throughput: dist-moe local, dispatched and pipelined layer vs Megatron-core's (bf16)")
def throughput(device):
    if device.type != "cuda":
        return "skip: a GPU measure"
    h, f, e, k, t = 1024, 4096, 8, 2, 16384
    x = torch.randn(t, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    ours = MoELayer(h, f, {"type": "switch", "num_experts": e, "top_k": k, "jitter_eps": 0.0}).to(device).bfloat16()

    def step(layer=ours):
        y, aux = layer(x)
        (y.float().square().mean() + aux).backward()

    rates = {"local": _tokens_per_s(step, t)}
    for chunks in (1, 4):
        ours.pipeline_chunks = chunks
        ours.dispatcher = ExpertParallelDispatcher(_one_rank_group(device), ours.placement, ours.topology, "rank")
        rates[f"C={chunks}"] = _tokens_per_s(step, t)
    mine = ", ".join(f"{n} {v:,.0f}" for n, v in rates.items()) + " tokens/s"
    try:
        return f"{mine}; Megatron {_megatron_tokens_per_s(device, x, h, f, e, k, t)}"
    except Exception as e:  # dist-moe's numbers stand whatever happens to the reference
        return f"{mine}; Megatron failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _megatron_tokens_per_s(device, x, h: int, f: int, e: int, k: int, t: int) -> str:
    """Megatron-core's MoE layer on the same tokens, with its grouped experts (TEGroupedMLP with Transformer
    Engine, else its GroupedMLP), seeded as its training seeds it."""
    try:
        parallel_state = engine_import("megatron.core", "parallel_state")
        get_moe_module_spec = engine_import("megatron.core.models.gpt.moe_module_specs", "get_moe_module_spec")
        MegatronMoE = engine_import("megatron.core.transformer.moe.moe_layer", "MoELayer")

        from dist_moe.integrations.megatron import megatron_config, seed_model_parallel_rng
    except (ImportError, ValueError):  # engine_import: a ValueError naming the extra when it is missing
        return "not measured: megatron-core is not installed"
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    seed_model_parallel_rng(1234)  # its GPU initialisation draws from these streams
    config = megatron_config(h, f, e, k, device=device, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01,
                             bf16=True, params_dtype=torch.bfloat16, moe_grouped_gemm=True)
    te = importlib.util.find_spec("transformer_engine") is not None
    theirs = MegatronMoE(config, submodules=get_moe_module_spec(use_te=te, num_experts=e,
                                                                 moe_grouped_gemm=True).submodules).to(device)
    xs = x.detach().unsqueeze(1).requires_grad_()

    def theirs_step():
        y, _ = theirs(xs)
        y.float().square().mean().backward()

    return f"{_tokens_per_s(theirs_step, t):,.0f} tokens/s ({type(theirs.experts).__name__})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="map CUDA to the CPU (gloo, the aten-level sync count)")
    ap.add_argument("--out", help="folder for gpu_check.json (default: none written)")
    ap.add_argument("--throughput", action="store_true", help="also measure tokens/s (GPU only; default off)")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; run with --cpu to map CUDA to the CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    where = "CPU (--cpu)" if args.cpu else f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    print(f"torch {torch.__version__}, {where}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-data-") as tmp:
        data = make_data(Path(tmp) / "data")
        device_choice(device)
        ep_sync(device)
        ep_fp32(device)
        ep_bf16(device)
        cuda_rng(device)
        local_sync(device)
        train_step_sync(device)
        grouped_vs_loop(device)
        grouped_edges(device)
        activation_memory(device)
        wire_bytes(device)
        ep_two_ranks(device)
        train_torch(device, data)
        train_bf16(device, data)
        train_deterministic(device, data)
        train_deepspeed(device, data)
        train_megatron(device, data)
        if args.throughput:
            throughput(device)
    print("\n" + "\n".join(f"{r['status']:<4} {r['check']}: {r['detail']}" for r in RESULTS))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1) + "\n")
    return 1 if any(r["status"] == "FAIL" for r in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
