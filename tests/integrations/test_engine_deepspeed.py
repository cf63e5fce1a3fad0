"""dist-moe strategies hosted in DeepSpeed 0.19.8's MoE layer (2 gloo ranks)."""
import pytest

from tests.support.dist_utils import run_cases

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'dist-moe[deepspeed]')")

STRATEGIES = ["switch", "deepseek_v3", "skywork", "hash", "uniform", "branch", "specdrop", "specdrop_bernoulli",
              "specdrop_hard", "specdrop_uniform"]


def _equivalence_worker(rank, world, routers):
    import deepspeed.comm as dscomm

    from dist_moe.integrations.context import routing_context
    from dist_moe.integrations.deepspeed import deepspeed_moe_layer, init_distributed, load_dist_moe_experts
    from placement import Placement
    from tests.support.engine_checks import ROUTERS, E, F, H, compare, rank_inputs, reference_layer

    init_distributed()
    placement = Placement.round_robin(E, world)  # non-contiguous: DeepSpeed's slots are relabelled
    for router in routers:
        ref = reference_layer(router, placement)
        ds = deepspeed_moe_layer(H, F, dict(ROUTERS[router]), ep_size=world, placement=placement)
        ds.set_deepspeed_parallelism()
        gate = ds.deepspeed_moe.gate
        gate.router.load_state_dict(ref.router.state_dict())
        load_dist_moe_experts(ds, ref.experts)
        experts = [dict(e.inner.named_parameters()) for e in ds.deepspeed_moe.experts.deepspeed_experts]

        x_all, cats, ids, w = rank_inputs(rank)
        x_ref = x_all.clone().requires_grad_()
        y_ref, aux_ref = ref(x_ref, categories=cats, token_ids=ids)
        ((y_ref * w).sum() + aux_ref).backward()
        x = x_all.clone().requires_grad_()
        sent = []  # what DeepSpeed's own all-to-all is handed (dispatch, then combine)
        original = dscomm.all_to_all_single

        def counting(output, tensor, *args, **kwargs):
            sent.append(tensor.numel() * tensor.element_size())
            return original(output, tensor, *args, **kwargs)

        dscomm.all_to_all_single = counting
        try:
            with routing_context(categories=cats, token_ids=ids):
                y, l_aux, counts = ds(x)
        finally:
            dscomm.all_to_all_single = original
        # DeepSpeed's convention: the gate's l_aux comes unscaled; the loop applies its coefficient
        aux = l_aux * getattr(gate.router, "aux_loss_coeff", 0.0)
        # equal splits: the share for the other ranks is the padded count, measured == analytic
        assert sent and sent[0] * (world - 1) // world == gate.traffic["padded_bytes"]
        ((y * w).sum() + aux).backward()
        compare(f"deepspeed/{router}", ref, y_ref, aux_ref, x_ref, y, aux, x, gate.router, experts)
        # useful payload: the copies the dist-moe layer sends without dedup; padded: E x C slots
        pairs = ref.last_routing.expert_idx
        remote = int(((pairs >= 0) & (placement.rank_tensor()[pairs.clamp_min(0)] != rank)).sum())
        assert gate.traffic["payload_bytes"] == remote * H * 4
        assert gate.traffic["padded_bytes"] >= gate.traffic["payload_bytes"]
        assert int(counts.sum()) == int((pairs >= 0).sum())


def _gar_worker(rank, world, host):
    import os

    from dist_moe.integrations.deepspeed import DeepSpeedHostedMoE, init_distributed, load_dist_moe_experts
    from dist_moe.moe.layer import MoELayerConfig
    from dist_moe.train.step.gar_step import gar_train_step
    from dist_moe.train.step.steppers import DeepSpeedStepper
    from tests.support.engine_checks import GAR_HIDDEN, GAR_KW, Record, gar_case

    os.environ.setdefault("LOCAL_RANK", str(rank))  # deepspeed.initialize checks it; launchers set it
    init_distributed()
    case = gar_case(rank, world)
    hosted = case.net(DeepSpeedHostedMoE(MoELayerConfig(GAR_HIDDEN, 8, dict(case.router)), world, case.placement))
    case.copy_dense(hosted)
    load_dist_moe_experts(hosted.moe.moe, case.ref.moe.experts)
    if host == "own step":  # GAR's own reduction and step over DeepSpeed-hosted experts
        opt = Record(hosted.parameters())
        out = gar_train_step(hosted, case.groups, case.loss_fn, opt, case.weights, sizes=case.sizes, **GAR_KW)
    else:  # deepspeed.initialize owns reduction and step; finish_external hands it GAR's gradients
        stepper = DeepSpeedStepper(hosted, 0.0, None, 4, optimizer_cls=Record)
        out = gar_train_step(hosted, case.groups, case.loss_fn, stepper.opt, case.weights, sizes=case.sizes,
                             finish=stepper.finish_external, **GAR_KW)
        opt = stepper.opt
    experts = hosted.moe.moe.deepspeed_moe.experts.deepspeed_experts
    case.check(host, out, opt.seen, hosted, lambda name, j: opt.seen[id(getattr(experts[j].inner, name))][0])


def test_deepspeed_hosted_layer_equals_dist_moe_for_every_strategy_and_gar_with_each_host():
    """Every strategy's forward and gradients, then GAR on DeepSpeed-hosted experts with GAR's own
    step and inside deepspeed.initialize (one set of ranks for the three cases)."""
    run_cases(2, [(_equivalence_worker, STRATEGIES), (_gar_worker, "own step"), (_gar_worker, "deepspeed engine")],
              timeout=420)


def test_capacity_is_deepspeeds_own_rule_with_its_min_capacity():
    """With a capacity factor the gate's C is DeepSpeed's _capacity (float32 arithmetic, min_capacity 8
    by default), so a user reproduces DeepSpeed's capacity exactly."""
    import torch
    from deepspeed.moe.sharded_moe import _capacity

    from dist_moe.integrations.deepspeed import DistMoEGate, deepspeed_capacity

    for tokens in (1, 7, 64, 100, 257, 1000, 4096):
        for e in (4, 8, 16, 64):
            for cf in (0.5, 1.0, 1.1, 1.25, 2.0, 3.3):
                for k in (1, 2, 4):
                    for min_cap in (0, 4, 8):
                        want = int(_capacity(torch.zeros(tokens, e), torch.tensor(cf * k), torch.tensor(min_cap)))
                        assert deepspeed_capacity(tokens, k, e, cf, min_cap) == want, (tokens, e, cf, k, min_cap)
    torch.manual_seed(0)
    gate = DistMoEGate({"type": "switch", "num_experts": 8, "top_k": 2}, 16, capacity_factor=1.25)
    assert gate.min_capacity == 8  # DeepSpeed's default
    _, capacity, *_ = gate(torch.randn(20, 16))
    assert capacity == int(_capacity(torch.zeros(20, 8), torch.tensor(1.25 * 2), torch.tensor(8))) == 8
    with pytest.raises(ValueError, match="min_capacity"):
        DistMoEGate({"type": "switch", "num_experts": 8}, 16, min_capacity=-1)


def test_a_users_own_expert_module_is_hosted_like_deepspeed_moe_does():
    import torch

    from dist_moe.integrations.deepspeed import DeepSpeedHostedMoE
    from dist_moe.moe.layer import MoELayerConfig
    from dist_moe.train.checkpoint.store import _expert_keys

    class Mine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.fc(x))

    torch.manual_seed(0)
    layer = DeepSpeedHostedMoE(MoELayerConfig(8, None, {"type": "switch", "num_experts": 4, "top_k": 2}), expert=Mine())
    copies = layer._local()
    assert len(copies) == 4 and all(isinstance(c, Mine) for c in copies)
    y, aux = layer(torch.randn(6, 8))
    (y.sum() + aux).backward()
    assert sum(c.fc.weight.grad is not None for c in copies) >= 2  # the routed copies were trained
    keys = _expert_keys(layer)  # checkpoints key each copy by its global expert id
    assert sorted(stem for _, stem, _ in keys.values()) == sorted(["experts.fc.weight", "experts.fc.bias"] * 4)
    assert sorted(ids[0] for ids, stem, _ in keys.values() if stem == "experts.fc.weight") == [0, 1, 2, 3]
    site = layer.moe_view()
    assert set(site.template) == {"fc.weight", "fc.bias"} and not site.stacked
