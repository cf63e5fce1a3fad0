"""The fp8 wire (``wire_dtype="fp8"``): the forward dispatch carries e4m3 values with one fp32 scale per 128
values of a row (a width not a multiple of 128 ends in a shorter group), as one row of bytes; the combine
and both backwards travel in bf16; node dedup's second hop forwards the packed rows without quantizing
again. On 4 ranks as 2 nodes x 2, rank and node dedup, 2 chunks, a width of 200: the ranks' measured
bytes equal ``dispatch_traffic`` of their routings at fp8's row bytes (200 + 4 x 2), half a bf16 row and a quarter of an
fp32 one, and outputs and input gradients are within e4m3's rounding (2**-4 of a group's largest value,
here 4 x that of the output's scale) of the bf16 wire's. Ranks that disagree on the wire are refused in
one line on every rank; GAR's capture and a torch without float8 are refused."""
import pytest
import torch

from dist_moe.dispatch.wire import dequantize, fp8_row_bytes, quantize
from tests.support.dist_utils import run_workers

H = 200


def test_quantize_round_trips_within_e4m3_rounding_per_group_of_128():
    g = torch.Generator().manual_seed(0)
    for width in (100, 128, 300):
        h = torch.randn(6, width, generator=g) * torch.logspace(-4, 4, 6).unsqueeze(1)
        packed = quantize(h)
        assert packed.dtype == torch.uint8 and packed.shape == (6, fp8_row_bytes(width))
        back = dequantize(packed, width, torch.float32)
        for start in range(0, width, 128):  # each group within 2**-4 of its own largest magnitude
            group = slice(start, start + 128)
            amax = h[:, group].abs().amax(1, keepdim=True)
            assert ((back[:, group] - h[:, group]).abs() <= amax * 2**-4).all(), (width, start)
        scales = packed[:, width:].contiguous().view(torch.float32)
        assert torch.equal(scales[:, 0], h[:, :128].abs().amax(1) / 448)
    assert quantize(torch.zeros(0, 300)).shape == (0, fp8_row_bytes(300))
    assert fp8_row_bytes(512) == 528 and fp8_row_bytes(200) == 208


def _fp8_worker(rank, world):
    import torch.distributed as dist

    import dist_moe.dispatch.wire as wire
    from dist_moe import MoELayer
    from placement import Topology, dispatch_traffic

    topo = Topology(("node", "gpu"), (2, world // 2))
    x = torch.randn(30, H, generator=torch.Generator().manual_seed(rank))
    quantized = [0]
    original = wire.quantize
    wire.quantize = lambda h: quantized.__setitem__(0, quantized[0] + 1) or original(h)
    runs = {}
    for name in ("bf16", "fp8", "fp32"):
        for dedup in ("rank", "node"):
            torch.manual_seed(0)
            layer = MoELayer(H, 64, {"type": "switch", "num_experts": 8, "top_k": 2, "jitter_eps": 0.0},
                             group=dist.group.WORLD, topology=topo, capacity_factor=None, dedup=dedup,
                             pipeline_chunks=2, wire_dtype=name)
            xi = x.clone().requires_grad_()
            quantized[0] = 0
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y, _ = layer(xi)
            assert quantized[0] == (name == "fp8"), (rank, dedup, quantized)  # once, on the source: never again
            (y.float() * torch.linspace(-1, 1, H)).sum().backward()
            row = {"fp8": fp8_row_bytes(H), "bf16": 2 * H, "fp32": 4 * H}[name]
            # a gateway's row holds what it forwards for its node: the ranks' measured rows sum to their routings'
            want = dispatch_traffic(layer.last_routing.expert_idx, rank, layer.placement, topo, row, dedup).matrix
            got = layer.traffic.matrix.clone()
            dist.all_reduce(want)
            dist.all_reduce(got)
            assert torch.equal(got, want), (rank, name, dedup)
            runs[name, dedup] = (y.float().detach(), xi.grad, int(layer.traffic.matrix.sum()))
    for dedup in ("rank", "node"):
        fp8, bf16, fp32 = (runs[n, dedup] for n in ("fp8", "bf16", "fp32"))
        assert fp8[2] * 2 * H == bf16[2] * fp8_row_bytes(H) and bf16[2] * 2 == fp32[2] > 0, (rank, dedup)
        for name, a, b in (("output", fp8[0], bf16[0]), ("input grad", fp8[1], bf16[1])):
            err, scale = (a - b).abs().max().item(), b.abs().max().item()
            assert 0 < err <= 4 * 2**-4 * scale, (rank, dedup, name, err, scale)


def test_fp8_dispatch_on_every_rank_counts_its_bytes_and_rounds_as_e4m3():
    run_workers(_fp8_worker, 4)


def _disagreeing_worker(rank, world):
    import torch.distributed as dist

    from dist_moe import MoELayer
    from placement import Topology

    torch.manual_seed(0)
    layer = MoELayer(H, 64, {"type": "switch", "num_experts": 4, "top_k": 2, "jitter_eps": 0.0},
                     group=dist.group.WORLD, topology=Topology(("node", "gpu"), (1, world)), capacity_factor=None,
                     wire_dtype="fp8" if rank == 1 else "bf16")
    with pytest.raises(ValueError) as e:
        layer(torch.randn(8, H))
    assert str(e.value).count("\n") == 0 and "rank 0: bf16, rank 1: fp8" in str(e.value), e.value


def test_ranks_that_disagree_on_the_wire_are_refused_on_every_rank():
    run_workers(_disagreeing_worker, 2)


def test_fp8_is_refused_where_it_cannot_hold(monkeypatch):
    from dist_moe.dispatch.wire import check_wire_dtype
    from dist_moe.train.config import load_config

    with pytest.raises(ValueError, match="train.gar"):
        load_config(None, ["parallel.wire_dtype=fp8", "router.type=switch", "train.gar.lambda=0.1"])
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match="wire_dtype fp8 needs torch's float8 dtypes"):
        check_wire_dtype("fp8")
