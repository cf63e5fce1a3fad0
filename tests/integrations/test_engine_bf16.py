"""``train.precision: bf16`` in the engines, layer by layer on 2 gloo ranks, against each engine's own bf16.

megatron: the engine keeps fp32 weights and runs the layer under autocast (bf16 GEMMs, fp32 router and
combine). Its reference is Megatron's own bf16 run: the same layer wrapped in ``Float16Module``
(``config.bf16``: bf16 weights, bf16 inputs) with Megatron's alltoall dispatcher. Through Megatron's
alltoall and through dist-moe's dispatcher the engine's layer gives that run's outputs and gradients.
deepspeed: the engine is DeepSpeed's own bf16 (``deepspeed.initialize`` with ``bf16.enabled``, via
``DeepSpeedStepper``); dist-moe's dispatcher behind it gives what DeepSpeed's own MOELayer gives.
Every weight and input is a bf16 number, so both sides compute from the same values; each rank
checks its own outputs and every gradient it holds.
"""
import zlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.support.dist_utils import run_cases

H, F, E, T = 16, 32, 4, 24
ROUTER = {"type": "switch", "num_experts": E, "top_k": 2, "jitter_eps": 0.0, "aux_loss_coeff": 0.01}
# bf16 has 8 significant bits: a GEMM result is off by up to ~2^-8 of its size, and a different
# order of the same bf16 operations (dispatch, chunks, grouped vs per-expert GEMMs) moves it by that much
BF16_TOL = 2e-2
# and an fp32 computation of the same numbers strays from another by ~1e-7, a bf16 one by ~1e-3
BF16_FLOOR = 1e-4


def rel(a, b) -> float:
    """max |a - b| over max |b|: one number per tensor, whatever its scale."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _bf16_numbers(module, rank: int, experts_per_rank: str) -> None:
    """Every parameter drawn from its name (expert copies also from the rank: each rank holds other
    experts) and rounded to a bf16 number, so a bf16 copy of the weights loses nothing."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters():
            seed = zlib.crc32(name.encode()) + (1000 * rank if experts_per_rank in name else 0)
            g = torch.Generator().manual_seed(seed)
            p.copy_((torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5).bfloat16().float())


def _rank_inputs(rank: int):
    import torch

    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(T, H, generator=g).bfloat16().float(), torch.randn(T, H, generator=g)


def _check(tag, rank, y, gx, grads, bf16_run, fp32_run) -> None:
    """Within bf16 tolerance of the engine's own bf16 run, output, input and every weight gradient; and
    computed in bf16: further from the engine's own fp32 run than fp32 arithmetic strays (~1e-7)."""
    y_ref, gx_ref, g_ref = bf16_run
    errors = {"output": rel(y, y_ref), "input grad": rel(gx, gx_ref)}
    errors.update({name: rel(g, g_ref[name]) for name, g in grads.items()})
    from_fp32 = rel(y, fp32_run[0])
    print(f"rank {rank} {tag}: max rel error {max(errors.values()):.1e} to the engine's bf16 run, "
          f"{from_fp32:.1e} to its fp32 run", flush=True)
    assert all(e < BF16_TOL for e in errors.values()), (rank, tag, errors)
    assert from_fp32 > BF16_FLOOR, (rank, tag, "computed in fp32", from_fp32)


class _StackedWeightCasts(TorchFunctionMode):
    """Counts fp32 -> bf16 casts of [E, in, out] stacked expert weights."""

    count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.Tensor.to and args[0].dim() == 3 and args[0].dtype == torch.float32 \
                and getattr(out, "dtype", None) == torch.bfloat16:
            self.count += 1
        return out


def _megatron_worker(rank, world):
    from dist_moe.integrations.megatron import patches as megatron_patches

    megatron_patches.apply()
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from dist_moe.dispatch.exchange import ExchangeConfig
    from dist_moe.integrations.megatron import MegatronHostedMoE, megatron_config
    from dist_moe.moe.layer import MoELayerConfig
    from placement import Placement

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(0)
    try:
        placement = Placement.round_robin(E, world)
        x_all, w = _rank_inputs(rank)

        def run(layer, autocast):
            x = x_all.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y, aux = layer(x)
            ((y.float() * w).sum() + aux).backward()
            grads = {n.removeprefix("module."): p.grad for n, p in layer.named_parameters()}
            return y.float().detach(), x.grad, grads

        def alltoall():
            return MegatronHostedMoE(MoELayerConfig(H, F, dict(ROUTER)), world, placement, dispatcher="alltoall")

        megatrons = alltoall()
        _bf16_numbers(megatrons, rank, "local_experts")
        state = megatrons.state_dict()
        fp32_run = run(megatrons, autocast=False)
        megatrons.zero_grad(set_to_none=True)
        # Megatron's own bf16 run: Float16Module (config.bf16) casts the weights and inputs to bf16
        reference = Float16Module(megatron_config(H, F, E, 2, world, bf16=True), megatrons)
        assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
        assert {b.dtype for b in reference.buffers() if b.is_floating_point()} <= {torch.float32}  # router state
        bf16_run = run(reference, autocast=False)
        layers = {"alltoall": alltoall()}
        for dedup, chunks in (("rank", 1), ("none", 2)):
            layers[f"dist_moe {dedup} x{chunks}"] = MegatronHostedMoE(
                MoELayerConfig(H, F, dict(ROUTER), exchange=ExchangeConfig(dedup, chunks)), world, placement,
                dispatcher="dist_moe")
        for tag, layer in layers.items():
            layer.load_state_dict(state)
            # the engine's bf16: fp32 weights (Adam's master copy), the forward under autocast (Runtime.compute)
            with _StackedWeightCasts() as casts:
                y, gx, grads = run(layer, autocast=True)
            if tag.startswith("dist_moe"):  # fc1 and fc2 cast once per forward, however many chunks
                assert casts.count == 2, (rank, tag, casts.count)
            assert all(p.dtype == torch.float32 for p in layer.parameters())
            _check(f"megatron {tag}", rank, y, gx, grads, bf16_run, fp32_run)
    finally:
        megatron_patches.release_parallel_state()


def _deepspeed_worker(rank, world):
    import os

    os.environ.setdefault("LOCAL_RANK", str(rank))  # deepspeed.initialize checks it; launchers set it
    import torch

    from dist_moe.integrations.deepspeed import init_distributed
    from dist_moe.train.step.steppers import DeepSpeedStepper
    from tests.integrations.test_deepspeed_dispatcher import _net

    init_distributed()
    g = torch.Generator().manual_seed(10 + rank)
    x_all, w = torch.randn(T, 8, generator=g).bfloat16().float(), torch.randn(T, generator=g)

    def run(precision, **dispatch):
        net = _net(world, 0, **dispatch)
        _bf16_numbers(net, rank, "deepspeed_experts")
        stepper = DeepSpeedStepper(net, 0.0, None, T, precision=precision)
        x = x_all.clone().requires_grad_()
        pred, l_aux = stepper.module(x)
        stepper.module.backward((pred.float() * w).sum() + l_aux.float())  # DeepSpeed's backward and reduction
        dtypes = {p.dtype for p in net.parameters()}
        assert dtypes == {torch.bfloat16 if precision == "bf16" else torch.float32}, (precision, dtypes)
        out = pred.float().detach(), x.grad, {n: p.grad.clone() for n, p in net.named_parameters()}
        with torch.no_grad():  # MOELayer keeps its last l_aux, whose graph holds the engine's output
            stepper.module(x_all)  # hooks: a cycle through autograd that gc cannot free (as evaluation does)
        return out

    # DeepSpeed's own MOELayer (capacity-padded all-to-all, dropless here) in fp32 and in its bf16
    fp32_run, bf16_run = run("fp32"), run("bf16")
    for dedup, chunks in (("rank", 1), ("node", 2)):
        y, gx, grads = run("bf16", dispatcher="dist_moe", dedup=dedup, pipeline_chunks=chunks)
        _check(f"deepspeed dist_moe {dedup} x{chunks}", rank, y, gx, grads, bf16_run, fp32_run)


def test_megatron_engine_bf16_equals_megatrons_own_bf16_through_either_dispatcher():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    run_cases(2, [(_megatron_worker,)], timeout=300)


def test_deepspeed_bf16_through_dist_moe_dispatcher_equals_its_own_moelayer():
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    run_cases(2, [(_deepspeed_worker,)], timeout=300)
