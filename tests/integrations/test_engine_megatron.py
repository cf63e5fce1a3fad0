"""dist-moe strategies hosted as megatron-core 0.16.1 routers (2 gloo ranks, CPU patches)."""
import pytest

from tests.support.dist_utils import run_cases

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'dist-moe[megatron]')")

STRATEGIES = ["switch", "deepseek_v3", "skywork", "hash", "uniform", "branch", "specdrop", "specdrop_bernoulli",
              "specdrop_hard", "specdrop_uniform"]


def _equivalence_worker(rank, world, routers, dispatcher):
    from dist_moe.integrations.megatron import patches as megatron_patches

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
    from tests.support.engine_checks import ROUTERS, E, F, H, compare, rank_inputs, reference_layer

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    placement = Placement.round_robin(E, world)  # non-contiguous: Megatron's columns are relabelled
    try:
        for router in routers:
            ref = reference_layer(router, placement)
            config = megatron_config(H, F, E, ref.router.top_k, ep_size=world, moe_token_dispatcher_type=dispatcher)
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
                    mg.router.last_routing.aux_loss, x, mg.router.router, grads)
            if dispatcher == "alltoall":  # one copy per (token, expert on another rank), like dedup="none"
                pairs = ref.last_routing.expert_idx
                remote = int(((pairs >= 0) & (placement.rank_tensor()[pairs.clamp_min(0)] != rank)).sum())
                assert sent_bytes(mg) == remote * H * 4
    finally:
        megatron_patches.release_parallel_state()  # destroy_model_parallel, and the groups 0.16.1 forgets


class _Grad:
    """Adapter: ``compare`` reads ``params[name].grad``."""

    def __init__(self, grad):
        self.grad = grad

    def __getattr__(self, name):
        return getattr(self.grad, name)


def _gar_worker(rank, world, dispatcher):
    from dist_moe.integrations.megatron import patches as megatron_patches

    megatron_patches.apply()
    from megatron.core import parallel_state

    from dist_moe.integrations.megatron import MegatronHostedMoE, load_dist_moe_experts
    from dist_moe.moe.layer import MoELayerConfig
    from dist_moe.train.step.gar_step import gar_train_step
    from tests.support.engine_checks import GAR_HIDDEN, GAR_KW, Record, gar_case

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    try:
        case = gar_case(rank, world, even=dispatcher == "allgather")
        hosted = case.net(MegatronHostedMoE(MoELayerConfig(GAR_HIDDEN, 8, dict(case.router)), world, case.placement,
                                            dispatcher=dispatcher))
        case.copy_dense(hosted)
        load_dist_moe_experts(hosted.moe.moe, case.ref.moe.experts)
        opt = Record(hosted.parameters())
        out = gar_train_step(hosted, case.groups, case.loss_fn, opt, case.weights, sizes=case.sizes, **GAR_KW)
        local = hosted.moe.moe.experts.local_experts

        def expert_grad(name, j):  # Megatron's layout -> dist-moe's slots
            fc1, fc2 = opt.seen[id(local[j].linear_fc1.weight)], opt.seen[id(local[j].linear_fc2.weight)]
            gate, up = fc1.chunk(2, 0)
            return {"w_gate": gate.t(), "w_up": up.t(), "w_down": fc2.t()}[name]

        case.check(f"megatron-{dispatcher}", out, opt.seen, hosted, expert_grad)
    finally:
        megatron_patches.release_parallel_state()  # destroy_model_parallel, and the groups 0.16.1 forgets


def test_megatron_hosted_layer_equals_dist_moe_for_every_strategy_and_gar_with_each_dispatcher():
    """Both of Megatron's dispatchers: every strategy's forward and gradients, then GAR on
    Megatron-hosted experts (one set of ranks for the four cases)."""
    cases = []
    for dispatcher in ("alltoall", "allgather"):
        cases += [(_equivalence_worker, STRATEGIES, dispatcher), (_gar_worker, dispatcher)]
    run_cases(2, cases, timeout=480)


def test_padding_mask_follows_megatrons_convention_true_is_padding():
    """megatron-core 0.16.1 treats padding_mask True as padding (its code inverts the mask; two
    docstrings say otherwise): padded tokens get no weight, valid ones keep theirs, exactly the rows
    Megatron's own compute_routing_scores_for_aux_loss zeroes."""
    from dist_moe.integrations.megatron import patches as megatron_patches

    megatron_patches.apply()
    import torch
    from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

    from dist_moe.integrations.megatron import DistMoERouter, megatron_config

    torch.manual_seed(0)
    s, b, h, e = 6, 3, 8, 4
    router = DistMoERouter(config=megatron_config(h, 16, e, 2), router={"type": "switch", "num_experts": e,
                                                                       "top_k": 2, "jitter_eps": 0.0})
    hidden = torch.randn(s, b, h)
    padding = torch.zeros(s, b, dtype=torch.bool)
    padding[4:, 0] = True  # the first sequence ends after 4 tokens
    padding[5:, 2] = True
    probs, routing_map = router(hidden, padding_mask=padding)
    logits = hidden.reshape(-1, h) @ router.router.node_map.weight.detach().t()
    _, scores = compute_routing_scores_for_aux_loss(logits, 2, "softmax", padding_mask=padding.reshape(-1))
    megatron_valid = scores.abs().sum(1) > 0
    assert torch.equal(probs.detach().abs().sum(1) > 0, megatron_valid)
    assert int((~megatron_valid).sum()) == 3
    assert routing_map.sum(1).eq(2).all()  # padding keeps its routes (Megatron sizes buffers as T x topk)


def test_megatron_conventions_coefficient_from_config_and_category_layout():
    """The aux-loss coefficient comes from config.moe_aux_loss_coeff (a conflicting router value, or one
    for a router without an aux loss, is refused), and categories must be in Megatron's [S, B] order."""
    from dist_moe.integrations.megatron import patches as megatron_patches

    megatron_patches.apply()
    import torch

    from dist_moe.integrations.context import routing_context
    from dist_moe.integrations.megatron import DistMoERouter, megatron_config

    cfg = megatron_config(8, 16, 4, 2, moe_aux_loss_coeff=0.05)
    r = DistMoERouter(config=cfg, router={"type": "switch"})
    assert r.router.aux_loss_coeff == 0.05 and r.router.top_k == 2  # both from Megatron's config
    with pytest.raises(ValueError, match="disagree"):
        DistMoERouter(config=cfg, router={"type": "switch", "aux_loss_coeff": 0.01})
    with pytest.raises(ValueError, match="has no auxiliary loss"):
        DistMoERouter(config=cfg, router={"type": "branch"})
    spec = DistMoERouter(config=megatron_config(8, 16, 4, 4), router={"type": "specdrop", "num_categories": 3})
    s, b = 5, 3
    hidden = torch.randn(s, b, 8)
    good = torch.randint(0, 3, (s, b))
    with routing_context(categories=good):
        spec(hidden)
    with routing_context(categories=good.t().contiguous()), pytest.raises(ValueError, match=r"\[S, B\] = \[5, 3\]"):
        spec(hidden)  # [B, S]: the right size, the wrong order
