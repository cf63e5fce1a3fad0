"""A Megatron-core GPTModel with dist-moe's router and dispatcher, plugged in through the layer spec.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 examples/megatron_gpt.py

Two decoder layers from ``get_gpt_layer_local_spec`` with an MoE FFN of 4 experts (expert
parallel over the launched ranks). The same model is built three times from one seed: with
Megatron's own TopKRouter and alltoall dispatcher; with ``DistMoERouter(switch)`` swapped into
``spec.submodules.mlp.submodules.router`` (Megatron's dispatcher still moves the tokens); and
with the MoE MLP replaced by ``dist_moe_mlp_spec`` (the one line: dist-moe's router and
dispatcher, here with node dedup, inside Megatron's MoE layer and experts). Router weights are
copied from the first. Where the semantics match (softmax before top-k, no jitter, Megatron's
aux_loss with the coefficient from ``config.moe_aux_loss_coeff``) all three train to the same
losses, step for step; the aux loss reaches Megatron's tracker (``track_moe_metrics``) from each.
Sequences end in padding, which the routers leave out of their statistics.
"""
import functools

import torch
import torch.distributed as dist

from dist_moe.integrations.megatron import patches as megatron_patches

megatron_patches.apply()  # CPU: no CUDA streams, no Transformer Engine (a no-op on GPUs)
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.moe.moe_utils import track_moe_metrics  # noqa: E402

from dist_moe.integrations.megatron import DistMoERouter, dist_moe_mlp_spec  # noqa: E402

STEPS, BATCH, SEQ, VOCAB, EXPERTS = 4, 4, 16, 64, 4


ROUTER = {"type": "switch", "jitter_eps": 0.0}


def build(config, host: str):
    torch.manual_seed(0)  # the same initial weights for all
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    if host == "router":  # dist-moe's router, Megatron's dispatcher
        spec.submodules.mlp.submodules.router = functools.partial(DistMoERouter, router=ROUTER)
    elif host == "spec":  # the one line: dist-moe's router and dispatcher in Megatron's MoE layer
        spec.submodules.mlp = dist_moe_mlp_spec(router=ROUTER, dedup="node", base=spec.submodules.mlp)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def copy_weights(megatron_model, dist_moe_model) -> None:
    theirs = dict(megatron_model.named_parameters())
    with torch.no_grad():
        for name, p in dist_moe_model.named_parameters():
            p.copy_(theirs[name.replace("router.router.node_map.weight", "router.weight")])


def train(model, config, rank: int, world: int) -> list[tuple[float, float]]:
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    out = []
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
        padding[:, SEQ - 1 - step:] = True  # the sequences end in padding
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        causal = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()  # True: masked out (Megatron's)
        loss = model(tokens[:, :-1], positions, causal, labels=tokens[:, 1:], padding_mask=padding)
        loss = (loss * ~padding).sum() / (~padding).sum()
        opt.zero_grad()
        loss.backward()
        for name, p in model.named_parameters():  # data parallelism for the replicated weights
            if world > 1 and ".experts." not in name:
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        tracked = {}
        track_moe_metrics(1.0, step, total_loss_dict=tracked, num_layers=config.num_layers)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        out.append((float(mean_loss) / world, float(tracked["load_balancing_loss"])))
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(0)  # Megatron's named RNG streams (on the CPU generator without CUDA)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=64,  # the experts' width (unset, Megatron warns that it takes ffn_hidden_size)
        cuda_graph_scope=[],  # the whole layer, as Megatron's default "full" is, which warns that it is deprecated
        moe_router_topk=2, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01,
        moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=world, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(), gradient_accumulation_fusion=False,
        bf16=False, params_dtype=torch.float32)
    megatron_model, router_model, spec_model = build(config, "megatron"), build(config, "router"), build(config, "spec")
    copy_weights(megatron_model, router_model)
    copy_weights(megatron_model, spec_model)
    theirs = train(megatron_model, config, rank, world)
    router = train(router_model, config, rank, world)
    spec = train(spec_model, config, rank, world)
    if rank == 0:
        for step, ((l1, a1), (l2, a2), (l3, a3)) in enumerate(zip(theirs, router, spec)):
            print(f"step {step}: loss TopKRouter {l1:.6f} DistMoERouter {l2:.6f} dist_moe_mlp_spec {l3:.6f}; "
                  f"load_balancing_loss {a1:.6f} {a2:.6f} {a3:.6f}")
    # Megatron 0.16.1's destroy_model_parallel forgets two groups, which would outlive the process group
    megatron_patches.release_parallel_state()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
