"""The engines' experts behind dist-moe's dispatcher run as grouped GEMMs over stacked views of the
engine's own weights (no copy per call); the per-expert loop they replace gives the same outputs and
gradients. Megatron's SequentialMLP (SwiGLU and GELU) and DeepSpeed's copies of dist-moe's experts,
through the engine layer on 1 and 2 gloo ranks (1 and 3 pipeline chunks); the loop is forced by
placing each weight in a storage of its own, as a buffer that re-homes parameters apart would.
Every rank checks its own."""
import pytest

from tests.support.dist_utils import run_cases

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'dist-moe[megatron]')")
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'dist-moe[deepspeed]')")

H, F, E, T = 16, 24, 4, 21
ROUTER = {"type": "switch", "num_experts": E, "top_k": 2, "jitter_eps": 0.0, "aux_loss_coeff": 0.01}


def _apart(params) -> None:
    """Each parameter in a storage of its own (the layout a per-parameter conversion leaves)."""
    import torch

    with torch.no_grad():
        for p in params:
            p.data = p.data.clone()


def _step(layer, run, rank):
    """Outputs, input gradient and every parameter's gradient of one forward + backward."""
    import torch

    g = torch.Generator().manual_seed(40 + rank)
    x = torch.randn(T + rank, H, generator=g).requires_grad_()
    w = torch.randn(T + rank, H, generator=g)
    layer.zero_grad(set_to_none=True)
    y, aux = run(layer, x)
    ((y * w).sum() + aux).backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def _check_paths(tag, layer, experts, expert_params, run, rank):
    import torch

    probe = torch.zeros(3, H)
    assert experts.grouped(probe), f"{tag}: the engine's experts do not run grouped"
    grouped = _step(layer, run, rank)
    _apart(expert_params)
    assert not experts.grouped(probe), f"{tag}: weights placed apart still run grouped"
    looped = _step(layer, run, rank)
    for a, b, what in ((grouped[0], looped[0], "output"), (grouped[1], looped[1], "input gradient")):
        assert torch.allclose(a, b, atol=1e-6), (tag, rank, what, (a - b).abs().max())
    assert grouped[2].keys() == looped[2].keys() and grouped[2], (tag, rank)
    for name, g in grouped[2].items():
        assert torch.allclose(g, looped[2][name], atol=1e-6), (tag, rank, name, (g - looped[2][name]).abs().max())
    experts.restack()  # laid out stacked again: grouped again, the same numbers
    assert experts.grouped(probe), tag
    again = _step(layer, run, rank)
    assert torch.allclose(again[0], grouped[0], atol=1e-6), (tag, rank)


def _megatron_worker(rank, world):
    from dist_moe.integrations.megatron import patches as megatron_patches

    megatron_patches.apply()
    import torch
    from megatron.core import parallel_state

    from dist_moe.integrations.megatron import megatron_config
    from dist_moe.integrations.megatron.layer import megatron_dist_moe_layer

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    try:
        def run(layer, x):
            y, _ = layer(x.unsqueeze(1))
            return y.squeeze(1), torch.zeros(())  # the aux loss rides on the probs

        for kind in ("swiglu", "gelu"):
            for chunks in (1, 3):
                torch.manual_seed(0)
                layer = megatron_dist_moe_layer(megatron_config(H, F, E, 2, world, expert_type=kind), dict(ROUTER),
                                                "rank", chunks)
                local = layer.experts.local_experts
                params = [m.linear_fc1.weight for m in local] + [m.linear_fc2.weight for m in local]
                _check_paths(f"megatron {kind} C={chunks}", layer, layer.routed_experts, params, run, rank)
        # a width the kernels refuse (10 fp32 numbers: 40 bytes, not a multiple of 16) runs the loop
        layer = megatron_dist_moe_layer(megatron_config(10, F, E, 2, world), dict(ROUTER), "rank", 1)
        assert not layer.routed_experts.grouped(torch.zeros(3, 10))
        y, _ = layer(torch.randn(T, 1, 10))
        assert torch.isfinite(y).all()
    finally:
        megatron_patches.release_parallel_state()


def _deepspeed_worker(rank, world):
    import torch

    from dist_moe.integrations.deepspeed import deepspeed_moe_layer, init_distributed

    init_distributed()

    def run(layer, x):
        y, l_aux, _ = layer(x)
        return y, l_aux

    for kind in ("swiglu", "gelu"):
        for chunks in (1, 3):
            torch.manual_seed(0)
            layer = deepspeed_moe_layer(H, F, dict(ROUTER), ep_size=world, expert_type=kind, dispatcher="dist_moe",
                                        pipeline_chunks=chunks)
            layer.set_deepspeed_parallelism()
            experts = layer.deepspeed_moe.routed_experts
            params = [p for c in layer.deepspeed_moe.experts.deepspeed_experts for p in c.parameters()]
            _check_paths(f"deepspeed {kind} C={chunks}", layer, experts, params, run, rank)
    # a user's own expert module is run copy by copy
    user = deepspeed_moe_layer(H, None, dict(ROUTER), ep_size=world, expert=torch.nn.Linear(H, H),
                               dispatcher="dist_moe")
    user.set_deepspeed_parallelism()
    assert not user.deepspeed_moe.routed_experts.grouped(torch.zeros(3, H))


@pytest.mark.parametrize("world", [1, 2])
def test_engine_experts_grouped_equal_their_loop(world):
    run_cases(world, [(_megatron_worker,), (_deepspeed_worker,)], timeout=300)
