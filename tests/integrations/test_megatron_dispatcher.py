"""dist-moe's dispatcher inside Megatron-core's MoE layer (``dist_moe_mlp_spec``), against Megatron's own.

A GPTModel built from ``get_gpt_layer_local_spec`` trains step for step like the same model with
Megatron's TopKRouter and alltoall dispatcher (weights copied; TopKRouter with softmax before top-k
and Megatron's aux loss is dist-moe's switch without jitter), on 1 rank (its experts run locally), 2
ranks and 4 as 2 nodes x 2, for every dedup mode and 1 or 3 pipeline chunks; the bytes the layers measured are
``placement.dispatch_traffic``'s for the routings they ran; Megatron's dist_checkpointing saves and
loads the model exactly; every rank checks its own losses, gradients and weights.
"""
from pathlib import Path

import pytest

from tests.support.dist_utils import run_cases

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'dist-moe[megatron]')")

STEPS, BATCH, SEQ, VOCAB, EXPERTS = 3, 2, 8, 32, 8


def _config(world):
    import torch
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=EXPERTS,
        moe_router_topk=2, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01,
        moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=world, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, bf16=False, params_dtype=torch.float32)


def _model(config, mlp=None, seed=0):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    if mlp is not None:
        spec.submodules.mlp = mlp(spec.submodules.mlp)  # the one line a Megatron user changes
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def _train(model, rank, world):
    """Per step this rank's loss (its own tokens; sequences ending in padding), and the first step's
    gradients by Megatron's parameter names."""
    import torch
    import torch.distributed as dist

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(100 + rank)
    losses, first = [], {}
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
        padding[:, SEQ - 1 - step:] = True
        causal = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()
        loss = model(tokens[:, :-1], torch.arange(SEQ).expand(BATCH, SEQ), causal, labels=tokens[:, 1:],
                     padding_mask=padding)
        loss = (loss * ~padding).sum() / (~padding).sum()
        opt.zero_grad()
        loss.backward()
        for name, p in model.named_parameters():  # data parallelism for the replicated weights
            if ".experts." not in name:
                dist.all_reduce(p.grad)
                p.grad /= world
        if step == 0:
            first = {n.replace("router.router.node_map.weight", "router.weight"): p.grad.clone()
                     for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
    return losses, first


def _check_bytes(model, topology, rank):
    """One forward's measured bytes per layer == dispatch_traffic of the routings every rank ran."""
    import torch
    import torch.distributed as dist

    from dist_moe.distributed.reductions import all_gather_rows
    from placement import dispatch_traffic

    layers = [m for m in model.modules() if hasattr(m, "reset_traffic")]
    assert len(layers) == 2  # both decoder layers' MoE, dist-moe's dispatcher in each
    for layer in layers:
        layer.reset_traffic()
    g = torch.Generator().manual_seed(7 + rank)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.arange(SEQ).expand(BATCH, SEQ),
              torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool())
    for layer in layers:
        idx = layer.router.last_routing.expert_idx
        src = all_gather_rows(torch.full((idx.shape[0],), rank, dtype=torch.long), dist.group.WORLD)
        want = dispatch_traffic(all_gather_rows(idx, dist.group.WORLD), src, layer.placement, topology, 16 * 4,
                                layer.dedup)
        got = layer.traffic.matrix.clone()
        dist.all_reduce(got)
        assert torch.equal(got, want.matrix), (rank, layer.dedup, got, want.matrix)
        assert int(got.sum()) > 0


def _save_and_load(model, makers, path):
    """Megatron's dist_checkpointing round trip: fresh models (this spec's, and the router swap's with
    Megatron's dispatcher: the same keys) load the saved one's weights exactly."""
    import torch
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True, exist_ok=True)  # Megatron saves into an existing, empty directory
    dist_checkpointing.save(model.sharded_state_dict(), str(path))
    mine = dict(model.named_parameters())
    for make in makers:
        fresh = make()  # seed 1: a different draw, so a weight left unloaded shows
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(path)))
        for name, p in fresh.named_parameters():
            assert torch.equal(p, mine[name]), (type(fresh.decoder.layers[0].mlp).__name__, name)


def _router_swap(base):
    """Today's Megatron host: DistMoERouter in Megatron's own MoELayer and dispatcher."""
    import functools

    from dist_moe.integrations.megatron import DistMoERouter

    base.submodules.router = functools.partial(DistMoERouter, router={"type": "switch", "jitter_eps": 0.0})
    return base


def _worker(rank, world, topology_spec, cases, ckpt_dir):
    from dist_moe.integrations.megatron import patches as megatron_patches

    megatron_patches.apply()
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dist_moe.integrations.megatron import dist_moe_mlp_spec
    from placement import Topology

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(0)
    topology = Topology.parse(topology_spec)
    try:
        config = _config(world)
        reference = _model(config)
        theirs = {n.replace("router.weight", "router.router.node_map.weight"): p.detach().clone()
                  for n, p in reference.named_parameters()}
        expected, expected_grads = _train(reference, rank, world)
        for dedup, chunks in cases:
            def spec(base, dedup=dedup, chunks=chunks):
                return dist_moe_mlp_spec({"type": "switch", "jitter_eps": 0.0}, dedup, chunks, topology=topology,
                                         base=base)

            ours = _model(config, spec)
            with torch.no_grad():
                for name, p in ours.named_parameters():
                    p.copy_(theirs[name])
            got, grads = _train(ours, rank, world)
            assert all(abs(a - b) < 1e-5 for a, b in zip(got, expected)), (rank, dedup, chunks, got, expected)
            for name, g in expected_grads.items():  # every weight's gradient, experts' on their own rank
                assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-7), (rank, dedup, chunks, name)
            if world > 1:  # one EP rank exchanges nothing: its experts run locally
                _check_bytes(ours, topology, rank)
        _save_and_load(ours, [lambda: _model(config, spec, seed=1), lambda: _model(config, _router_swap, seed=1)],
                       Path(ckpt_dir))
    finally:
        megatron_patches.release_parallel_state()


@pytest.mark.parametrize("world,topology,dedups", [(1, "gpu=1", ("rank",)), (2, "gpu=2", ("none", "rank")),
                                                   (4, "node=2,gpu=2", ("none", "rank", "node"))])
def test_gpt_model_through_dist_moe_dispatcher_trains_like_megatrons_alltoall(world, topology, dedups, tmp_path):
    cases = [(dedup, chunks) for dedup in dedups for chunks in (1, 3)]
    run_cases(world, [(_worker, topology, cases, str(tmp_path / "ckpt"))], timeout=600)


def test_megatron_configs_the_layer_cannot_honour_are_refused_by_name():
    from types import SimpleNamespace

    from dist_moe.integrations.megatron.layer import _check_config

    for key, value in (("moe_expert_capacity_factor", 1.0), ("moe_apply_probs_on_input", True),
                       ("moe_latent_size", 8), ("moe_shared_expert_overlap", True),
                       ("expert_tensor_parallel_size", 2)):
        with pytest.raises(ValueError, match=f"config.{key}="):
            _check_config(SimpleNamespace(**{key: value}))
    _check_config(SimpleNamespace(moe_expert_capacity_factor=None, expert_tensor_parallel_size=1))  # accepted
