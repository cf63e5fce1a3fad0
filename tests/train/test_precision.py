"""train.precision bf16 on dist-moe's own engine: the experts' GEMMs in bf16 under autocast, routers and
the combine in fp32, weights, gradients and Adam state fp32, a pipelined dispatch casting each expert
weight once per forward and adding every chunk's gradient into one fp32 buffer; the loss of a bf16
run tracks the fp32 run's."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist_moe import MoELayer
from dist_moe.train.config import load_config
from dist_moe.train.trainer import train
from tests.support.dist_utils import run_workers


class _Ops(TorchDispatchMode):
    """(op name, output dtype, output shape) of every aten op run inside."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.ops.append((str(func.overloadpacket), out.dtype, tuple(out.shape)))
        return out


def test_bf16_autocast_runs_expert_gemms_in_bf16_routing_and_combine_in_fp32():
    torch.manual_seed(0)
    layer = MoELayer(32, 16, {"type": "branch", "num_experts": 8, "top_k": 2})
    x = torch.randn(40, 32, requires_grad=True)
    with _Ops() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        y, aux = layer(x)
    gemms = [dtype for name, dtype, _ in seen.ops if name == "aten._grouped_mm"]
    assert gemms and set(gemms) == {torch.bfloat16}, gemms  # every expert projection, grouped, in bf16
    assert y.dtype == torch.float32 and layer.last_routing.probs.dtype == torch.float32 and aux.dtype == torch.float32
    (y.square().sum() + aux).backward()
    assert all(p.grad.dtype == torch.float32 for p in layer.parameters() if p.grad is not None)
    with torch.no_grad():  # the same layer in fp32: bf16 rounding apart, the same output
        y32, _ = layer(x)
    torch.testing.assert_close(y.detach(), y32, rtol=0.05, atol=0.05)


def _chunked_worker(rank, world):
    import torch.distributed as dist

    torch.manual_seed(0)
    layer = MoELayer(32, 16, {"type": "switch", "num_experts": 4, "top_k": 2}, group=dist.group.WORLD,
                     pipeline_chunks=3)
    weights = {tuple(p.shape) for p in layer.experts.parameters()}
    count = len(list(layer.experts.parameters()))
    x = torch.randn(30 + rank, 32, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    with _Ops() as forward, torch.autocast("cpu", dtype=torch.bfloat16):
        y, aux = layer(x)
    casts = [op for op in forward.ops if op[0] == "aten._to_copy" and op[2] in weights and op[1] == torch.bfloat16]
    # once per weight and forward (3 chunks: 3 casts each before)
    assert len(casts) == count, (rank, casts)
    with _Ops() as backward:
        (y.square().sum() + aux).backward()
    fills = ("aten.zeros_like", "aten.zeros", "aten.new_zeros", "aten.fill_")
    zero_fills = [op for op in backward.ops if op[0] in fills and op[2] in weights]
    assert len(zero_fills) <= count, (rank, zero_fills)  # one fp32 buffer per weight, not one per chunk
    assert all(p.grad.dtype == torch.float32 for p in layer.experts.parameters())


def test_a_pipelined_bf16_forward_casts_each_expert_weight_once_and_sums_grads_in_one_fp32_buffer():
    run_workers(_chunked_worker, 2, timeout=120)


def _demo(precision: str, tmp_path, steps: int = 60) -> dict:
    cfg = load_config(None, [f"train.precision={precision}", f"train.max_steps={steps}", "data.max_rows=4000",
                             f"output.dir={tmp_path / precision}", "model.d_model=32"])
    return train(cfg, quiet=True)


def test_a_bf16_run_keeps_fp32_weights_and_optimizer_state_and_tracks_the_fp32_loss(tmp_path, monkeypatch):
    from dist_moe.train.step import steppers

    kept = {}
    real = steppers.LocalStepper.__call__

    def step(self, loss):  # the state after each bf16 step
        out = real(self, loss)
        kept["dtypes"] = {p.dtype for p in self.params} | {v.dtype for s in self.opt.state.values()
                                                             for k, v in s.items() if k != "step"}
        return out

    monkeypatch.setattr(steppers.LocalStepper, "__call__", step)
    bf16 = _demo("bf16", tmp_path)
    assert kept["dtypes"] == {torch.float32}
    fp32 = _demo("fp32", tmp_path)
    assert bf16["val_loss"] < 0.6 and abs(bf16["val_loss"] - fp32["val_loss"]) < 0.02, (bf16["val_loss"],
                                                                                        fp32["val_loss"])


def test_gar_with_bf16_is_refused_in_one_line():
    with pytest.raises(ValueError, match="train.gar trains in fp32 only: set train.precision: fp32"):
        load_config(None, ["router.type=switch", "train.gar={lambda: 0.1}", "train.precision=bf16"])
