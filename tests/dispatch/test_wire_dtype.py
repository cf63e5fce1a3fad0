"""What rows travel in (``wire_dtype``): under bf16 autocast they cross in bf16 by default (auto), half the fp32
wire's bytes on the same routing, both ways; ``fp32`` keeps them fp32; a named bf16 wire under fp32 training
rounds the rows and results on the way only (the experts still compute in fp32). Checked on every rank, with
rank dedup and 2 chunks, against the same layer with an fp32 wire: within bf16's rounding of what travels."""
import pytest

from tests.support.dist_utils import run_workers

H, E, K, T = 16, 4, 2, 24


def _run(layer, x, bf16: bool):
    import torch

    layer.reset_traffic()
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y, _ = layer(x)
    (y.float() * torch.linspace(-1, 1, H)).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    return y.detach().float(), x.grad.clone(), grads, int(layer.traffic.matrix.sum())


def _wire_worker(rank, world):
    import torch
    import torch.distributed as dist

    from dist_moe import MoELayer
    from placement import Topology

    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank))
    layers = {}
    for wire in ("auto", "fp32", "bf16"):
        torch.manual_seed(0)
        layers[wire] = MoELayer(H, 32, {"type": "switch", "num_experts": E, "top_k": K, "jitter_eps": 0.0},
                                group=dist.group.WORLD, topology=Topology(("node", "gpu"), (1, world)),
                                capacity_factor=None, pipeline_chunks=2, wire_dtype=wire)
    # fp32 training: auto is fp32, bit for bit; a named bf16 wire halves the bytes, rounding what travels
    auto, fp32, bf16 = (_run(layers[w], x, False) for w in ("auto", "fp32", "bf16"))
    assert auto[3] > 0 and auto[3] == fp32[3] and 2 * bf16[3] == fp32[3], (rank, auto[3], fp32[3], bf16[3])
    assert torch.equal(auto[0], fp32[0]) and torch.equal(auto[1], fp32[1])
    _close(bf16, fp32, rank, "bf16 wire, fp32 training")
    # bf16 autocast: auto travels in bf16
    auto, fp32 = (_run(layers[w], x, True) for w in ("auto", "fp32"))
    assert 2 * auto[3] == fp32[3], (rank, auto[3], fp32[3])
    _close(auto, fp32, rank, "auto wire under bf16")


def _close(got, want, rank, what):
    """Outputs and gradients within a few bf16 roundings of the fp32 wire's (rows, results, gradients each
    rounded once on the way: relative 2**-8 each, on values of the tensor's scale)."""
    import torch

    for name, a, b in (("output", got[0], want[0]), ("input grad", got[1], want[1]),
                       *((f"grad {n}", got[2][n], want[2][n]) for n in want[2])):
        tol = 4 * 2**-8 * b.abs().max().item() + 1e-6
        err = (a - b).abs().max().item()
        assert err <= tol, (rank, what, name, err, tol)
    assert not torch.equal(got[0], want[0]), (rank, what, "the wire changed nothing")


def test_rows_travel_in_the_wire_dtype_on_every_rank():
    run_workers(_wire_worker, 2)


def test_a_wire_dtype_not_offered_is_refused_in_one_line():
    from dist_moe.dispatch.exchange import ExchangeConfig
    from dist_moe.train.config import load_config

    with pytest.raises(ValueError, match=r"wire_dtype must be one of \('auto', 'fp32', 'bf16', 'fp8'\), got 'fp16'"):
        ExchangeConfig(wire_dtype="fp16")
    with pytest.raises(ValueError, match="parallel.wire_dtype"):
        load_config(None, ["parallel.wire_dtype=fp16"])
    with pytest.raises(ValueError, match="parallel.wire_dtype=bf16 sets what dist-moe's dispatcher sends"):
        load_config(None, ["engine=deepspeed", "parallel.dispatcher=engine", "parallel.wire_dtype=bf16",
                           "model.capacity_factor=null"])
    cfg = load_config(None, ["engine=deepspeed", "parallel.wire_dtype=bf16", "model.capacity_factor=null"])
    assert cfg.parallel.dispatches("deepspeed")  # a named wire dtype is dist-moe's dispatcher's (auto takes it)
