"""Experts run each projection as one grouped GEMM over all local experts (F.grouped_mm); the per-expert loop
stays where a grouped GEMM cannot run. Both paths give the same outputs and gradients."""
import pytest
import torch

from dist_moe.dispatch.apply_experts import apply_experts
from dist_moe.moe.experts import Experts, FactorCapture

COUNTS = [[3, 0, 5, 1], [0, 0, 0, 0], [0, 9, 0, 0]]  # empty experts, no rows at all, one expert only


def _both(kind: str, counts: list[int], hidden: int = 16, ffn: int = 8, dtype=torch.float32):
    torch.manual_seed(0)
    experts = Experts(len(counts), hidden, ffn, kind).to(dtype)
    if kind == "lora":  # B starts at zero: give it values so its gradient path is exercised too
        with torch.no_grad():
            experts.lora_B.normal_()
    x = torch.randn(sum(counts), hidden, dtype=dtype, requires_grad=True)
    g = torch.randn(sum(counts), hidden, dtype=dtype)
    params = [x, *experts.template().values()]
    out = {}
    for path, run in (("grouped", lambda: experts(x, torch.tensor(counts))),
                      ("looped", lambda: experts._looped_forward(x, counts, None))):
        y = run()
        out[path] = (y, *torch.autograd.grad(y, params, g, allow_unused=True))
    return experts, out


@pytest.mark.parametrize("kind", ["swiglu", "gelu", "lora"])
@pytest.mark.parametrize("counts", COUNTS)
def test_grouped_experts_equal_the_loop(kind, counts):
    """To fp32 rounding: an expert with a single row runs the loop's matrix-vector kernel, 1 ulp apart
    (measured up to 5e-7 on values of order 1); every other case here is bit for bit."""
    experts, out = _both(kind, counts)
    assert experts.grouped(torch.zeros(1, 16))
    for grouped, looped in zip(out["grouped"], out["looped"]):
        assert (grouped is None) == (looped is None)
        if grouped is not None:
            torch.testing.assert_close(grouped, looped, rtol=1e-6, atol=1e-6)
            if 1 not in counts:
                assert torch.equal(grouped, looped)


@pytest.mark.parametrize("kind", ["swiglu", "lora"])
def test_grouped_experts_in_bf16_match_the_loop_in_bf16(kind):
    _, out = _both(kind, [4, 0, 7, 5], dtype=torch.bfloat16)
    for grouped, looped in zip(out["grouped"], out["looped"]):
        if grouped is not None:
            assert grouped.dtype == torch.bfloat16
            torch.testing.assert_close(grouped, looped, rtol=2e-2, atol=2e-2)


def test_the_loop_runs_where_a_grouped_gemm_cannot():
    # rows of 10 fp32 values are 40 bytes: not the kernels' multiple of 16
    narrow = Experts(2, 10, 8)
    assert not narrow.grouped(torch.zeros(1, 10))
    x = torch.randn(6, 10)
    assert torch.equal(narrow(x, [2, 4]), narrow._looped_forward(x, [2, 4], None))
    wide = Experts(2, 16, 8)
    assert wide.grouped(torch.zeros(1, 16))
    assert not wide.grouped(torch.zeros(1, 16, dtype=torch.float64))  # no grouped kernel for fp64
    wide.capture = FactorCapture()  # GAR's Gram mode records each expert's block factors apart
    assert not wide.grouped(torch.zeros(1, 16))
    wide(torch.randn(6, 16, requires_grad=True), [2, 4])
    assert len(wide.capture.inputs["w_gate"]) == 2  # one recorded block input per expert: the loop ran


def test_the_local_path_counts_on_the_device_and_reads_nothing_back(monkeypatch):
    experts = Experts(4, 16, 8)
    x, slot = torch.randn(10, 16), torch.tensor([3, 0, 0, 2, 3, 1, 0, 2, 2, 3])
    row, gate = torch.arange(10), torch.rand(10)
    expected = apply_experts(experts, x, row, slot, gate)

    def no_host_read(*args, **kwargs):
        raise AssertionError("a host read in the grouped local path")

    monkeypatch.setattr(torch.Tensor, "tolist", no_host_read)
    monkeypatch.setattr(torch.Tensor, "item", no_host_read)
    assert torch.equal(apply_experts(experts, x, row, slot, gate), expected)
