"""The wire dtype in every host of dist-moe's dispatcher beside its own MoELayer (tests/dispatch): the engines'
layers (Megatron's MoELayer, DeepSpeed's MOELayer) and a transformers model's experts as ``model.kind: hf``
hosts them (a tiny DeepSeek-V3, hidden 32: its logits and embedding gradients), on 2 gloo ranks, each
against the same host with an fp32 wire: under fp32 training ``auto`` is that wire bit for bit; under bf16
autocast the bf16 wire's outputs and input gradients are within 4 bf16 roundings (4 x 2**-8) of the
output's scale of the fp32 wire's, the fp8 wire's within 4 e4m3 roundings (4 x 2**-4), and each sends 1/2
and 264/1024 of the fp32 wire's bytes (hidden 256: 256 e4m3 values and 2 fp32 scales a row; hidden 32: 36
bytes a row). Every rank checks its own. transformers' own expert parallelism with ``use(exchange=...)``
takes the same ExchangeConfig."""
from tests.support.dist_utils import run_cases

H, F, E, T = 256, 32, 4, 24
ROUTER = {"type": "switch", "num_experts": E, "top_k": 2, "jitter_eps": 0.0}
def wire_bytes(hidden: int) -> dict:
    return {"fp32": 4 * hidden, "bf16": 2 * hidden, "fp8": hidden + 4 * -(-hidden // 128)}
ROUNDING = {"bf16": 4 * 2**-8, "fp8": 4 * 2**-4}


def _run(layer, x, autocast: bool, call):
    """(output, input gradient, bytes sent): ``call(layer, x)`` gives (output, what to differentiate, counters)."""
    import torch

    xi = x.clone().requires_grad_() if x.is_floating_point() else x
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y, wrt, counters = call(layer, xi)
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    grad = xi.grad if wrt is None else wrt.grad.clone()
    layer.zero_grad(set_to_none=True)
    sent = sum(int(c.traffic.matrix.sum()) for c in counters)
    for c in counters:
        c.reset_traffic()
    return y.detach().float(), grad, sent


def _layer_call(layer, x):
    from dist_moe.moe.view import bytes_counter

    return layer(x)[0], None, [bytes_counter(getattr(layer, "deepspeed_moe", layer))]  # DeepSpeed's MoE wraps it


def _compare(host: str, rank: int, make, call=_layer_call, x=None, hidden: int = H) -> None:
    """``make(wire)``: the host with that wire dtype (same weights each time); ``call``: as ``_run`` takes it."""
    import torch

    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)) if x is None else x
    per_row = wire_bytes(hidden)
    auto, fp32 = (_run(make(w), x, False, call) for w in ("auto", "fp32"))
    assert torch.equal(auto[0], fp32[0]) and torch.equal(auto[1], fp32[1]) and auto[2] == fp32[2] > 0, (host, rank)
    want = _run(make("fp32"), x, True, call)
    for wire in ("bf16", "fp8"):
        got = _run(make(wire), x, True, call)
        assert got[2] * per_row["fp32"] == want[2] * per_row[wire], (host, rank, wire, got[2], want[2])
        for name, a, b in (("output", got[0], want[0]), ("input grad", got[1], want[1])):
            err, scale = (a - b).abs().max().item(), b.abs().max().item()
            assert 0 < err <= ROUNDING[wire] * scale, (host, rank, wire, name, err, scale)


def _megatron_worker(rank, world):
    from dist_moe.integrations.megatron import patches as megatron_patches

    megatron_patches.apply()
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dist_moe.dispatch.exchange import ExchangeConfig
    from dist_moe.integrations.megatron import MegatronHostedMoE
    from dist_moe.moe.layer import MoELayerConfig
    from placement import Placement

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(0)
    try:
        def make(wire):
            torch.manual_seed(0)
            return MegatronHostedMoE(MoELayerConfig(H, F, dict(ROUTER), exchange=ExchangeConfig(
                "rank", 2, wire_dtype=wire)), world, Placement.round_robin(E, world), dispatcher="dist_moe")

        _compare("megatron", rank, make)
    finally:
        megatron_patches.release_parallel_state()


def _deepspeed_worker(rank, world):
    import os

    os.environ.setdefault("LOCAL_RANK", str(rank))
    import torch

    from dist_moe.dispatch.exchange import ExchangeConfig
    from dist_moe.integrations.deepspeed import deepspeed_moe_layer, init_distributed
    from placement import Placement

    init_distributed()

    def make(wire):
        torch.manual_seed(0)
        layer = deepspeed_moe_layer(H, F, dict(ROUTER), ep_size=world, placement=Placement.round_robin(E, world),
                                    dispatcher="dist_moe", exchange=ExchangeConfig("node", 2, wire_dtype=wire))
        layer.set_deepspeed_parallelism()
        return layer

    _compare("deepspeed", rank, make)


def _hf_worker(rank, world):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from dist_moe.dispatch.exchange import ExchangeConfig
    from dist_moe.integrations.transformers.hosted import host_experts
    from placement import Placement, Topology
    from tests.support.hf_models import config

    def make(wire):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config("deepseek_v3", 64, nodes=1))
        topology = Topology(("node", "gpu"), (1, world))
        model.hosts = host_experts(model, lambda e: Placement.contiguous(e, world), topology, dist.group.WORLD,
                                   ExchangeConfig("rank", 2, wire_dtype=wire))
        return model

    def call(model, ids):
        embeddings = model.get_input_embeddings().weight
        return model(input_ids=ids).logits, embeddings, model.hosts

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(rank))
    _compare("transformers (model.kind hf)", rank, make, call, ids, hidden=32)


def test_every_engine_host_behind_dist_moe_sends_the_wire_dtype():
    import pytest

    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    run_cases(2, [(_megatron_worker,), (_deepspeed_worker,), (_hf_worker,)], timeout=300)
