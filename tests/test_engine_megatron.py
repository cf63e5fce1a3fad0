"""dist-moe strategies hosted as megatron-core 0.16.1 routers (2 gloo ranks, CPU patches)."""
import pytest

from tests.dist_utils import run_workers

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'dist-moe[megatron]')")

STRATEGIES = ["switch", "deepseek_v3", "skywork", "hash", "uniform", "branch", "specdrop", "specdrop_bernoulli",
              "specdrop_hard", "specdrop_uniform"]


def _equivalence_worker(rank, world, routers, dispatcher):
    from dist_moe.integrations import megatron_patches

    megatron_patches.apply()
    from megatron.core import parallel_state

    from dist_moe.integrations.context import routing_context
    from dist_moe.integrations.megatron import (
        expert_grads_as_dist_moe,
        load_dist_moe_experts,
        megatron_config,
        megatron_moe_layer,
        sent_bytes,
    )
    from placement import Placement
    from tests.engine_checks import E, F, H, ROUTERS, compare, rank_inputs, reference_layer

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    placement = Placement.round_robin(E, world)  # non-contiguous: Megatron's columns are relabelled
    try:
        for router in routers:
            ref = reference_layer(router, placement)
            config = megatron_config(H, F, E, ref.router.top_k, ep_size=world, dispatcher=dispatcher)
            mg = megatron_moe_layer(config, dict(ROUTERS[router]), placement)
            mg.router.router.load_state_dict(ref.router.state_dict())
            load_dist_moe_experts(mg, ref.experts)

            x_all, cats, ids, w = rank_inputs(rank)
            x_ref = x_all.clone().requires_grad_()
            y_ref, aux_ref = ref(x_ref, categories=cats, token_ids=ids)
            ((y_ref * w).sum() + aux_ref).backward()
            x = x_all.clone().requires_grad_()
            with routing_context(categories=cats, token_ids=ids):  # [S=T, B=1]: same token order
                y, _ = mg(x.unsqueeze(1))
            # Megatron backpropagates the aux loss through the probs (MoEAuxLossAutoScaler)
            (y.squeeze(1) * w).sum().backward()
            grads = [{k: _Grad(v) for k, v in g.items()} for g in expert_grads_as_dist_moe(mg)]
            compare(f"megatron-{dispatcher}/{router}", ref, y_ref, aux_ref, x_ref, y.squeeze(1),
                    mg.router.last_aux_loss, x, mg.router.router, grads)
            if dispatcher == "alltoall":  # one copy per (token, expert on another rank), like dedup="none"
                pairs = ref.last_routing.expert_idx
                remote = int(((pairs >= 0) & (placement.rank_tensor()[pairs.clamp_min(0)] != rank)).sum())
                assert sent_bytes(mg) == remote * H * 4
    finally:
        parallel_state.destroy_model_parallel()


class _Grad:
    """Adapter: ``compare`` reads ``params[name].grad``."""

    def __init__(self, grad):
        self.grad = grad

    def __getattr__(self, name):
        return getattr(self.grad, name)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_megatron_hosted_layer_equals_dist_moe_layer_for_every_strategy(dispatcher):
    run_workers(_equivalence_worker, 2, args=(STRATEGIES, dispatcher), timeout=300)
