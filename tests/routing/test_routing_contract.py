"""Every strategy satisfies the Routing contract, and bad input fails naming the problem."""
import math

import pytest
import torch

from dist_moe.routing import Routing, build_router

H, E, T = 12, 8, 40
CONFIGS = {
    "switch": {"type": "switch", "hidden_size": H, "num_experts": E, "top_k": 2},
    "switch_capacity": {"type": "switch", "hidden_size": H, "num_experts": E, "top_k": 2, "capacity_factor": 0.5},
    "deepseek_v3": {"type": "deepseek_v3", "hidden_size": H, "num_experts": E, "top_k": 2},
    "deepseek_v3_softmax": {"type": "deepseek_v3", "hidden_size": H, "num_experts": E, "top_k": 2,
                            "score_func": "softmax"},
    "skywork": {"type": "skywork", "hidden_size": H, "num_experts": E, "top_k": 2},
    "hash": {"type": "hash", "num_experts": E, "top_k": 2},
    "uniform": {"type": "uniform", "num_experts": E},
    "branch": {"type": "branch", "hidden_size": H, "num_experts": E, "top_k": 4},
    "branch_mlp": {"type": "branch", "hidden_size": H, "num_experts": E, "top_k": 1, "node_map": "mlp",
                   "mlp_hidden": 4},
    "switch_mlp": {"type": "switch", "hidden_size": H, "num_experts": E, "top_k": 2, "node_map": "mlp",
                   "mlp_hidden": 4},
    "specdrop": {"type": "specdrop", "num_experts": E, "num_categories": 5, "p_assigned": 0.7},
    "specdrop_bernoulli": {"type": "specdrop", "num_experts": E, "num_categories": 5, "p_assigned": 0.7,
                           "variant": "bernoulli"},
    "specdrop_hard_top2": {"type": "specdrop", "num_experts": E, "num_categories": 5, "p_assigned": 0.9,
                           "variant": "hard", "top_k": 2},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("training", [True, False])
def test_contract(name, training):
    router = build_router(CONFIGS[name]).train(training)
    x = torch.randn(T, H, requires_grad=True)
    cats = torch.randint(0, 5, (T,))
    r = router(x, categories=cats)
    assert isinstance(r, Routing)
    k = router.top_k
    assert r.probs.shape == (T, E) and r.probs.dtype == torch.float32
    assert torch.allclose(r.probs.sum(1), torch.ones(T), atol=1e-5)
    assert r.expert_idx.shape == (T, k) and r.expert_idx.dtype == torch.int64
    assert r.gates.shape == (T, k) and torch.isfinite(r.gates).all() and (r.gates >= 0).all()
    assert r.aux_loss.dim() == 0 and torch.isfinite(r.aux_loss)
    assert r.stats["load"].shape == (E,)
    kept = r.expert_idx >= 0
    assert ((r.expert_idx < E) & (r.expert_idx >= -1)).all()
    # selected experts are distinct per token and ordered by probability, highest first
    for row, krow in zip(r.expert_idx, kept):
        assert len(set(row[krow].tolist())) == int(krow.sum())
    if kept.all():
        p_sel = r.probs.gather(1, r.expert_idx)
        assert (p_sel[:, :-1] >= p_sel[:, 1:] - 1e-7).all()
    if name.startswith("specdrop"):
        assert torch.allclose(r.stats["load"].sum(), r.gates.sum())
    else:
        assert int(r.stats["load"].sum()) == int(kept.sum())


def test_branch_top_k_aux_is_zero_and_switch_aux_scaled():
    x = torch.randn(T, H)
    assert float(build_router(CONFIGS["branch"])(x).aux_loss) == 0.0
    sw = build_router(CONFIGS["switch"])
    sw2 = build_router({**CONFIGS["switch"], "aux_loss_coeff": 0.02})
    sw2.load_state_dict(sw.state_dict())
    sw.eval(), sw2.eval()
    assert math.isclose(float(sw2(x).aux_loss.detach()), 2 * float(sw(x).aux_loss.detach()), rel_tol=1e-6)


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"type": "bogus"}, "'type'"),
        ({**CONFIGS["switch"], "topk": 2}, "'topk'"),
        ({"type": "branch", "num_experts": 8, "top_k": 2}, "'hidden_size'"),
        ({**CONFIGS["branch"], "num_experts": 12}, "power of two"),
        ({**CONFIGS["branch"], "top_k": 9}, "top_k"),
        ({**CONFIGS["branch"], "top_k": "2"}, "'top_k'"),
        ({**CONFIGS["branch"], "ema_decay": 1.5}, "ema_decay"),
        ({**CONFIGS["branch"], "node_map": "mlp"}, "mlp_hidden"),
        ({**CONFIGS["branch"], "node_map": "conv"}, "node_map"),
        ({**CONFIGS["switch"], "capacity_factor": 0}, "capacity_factor"),
        ({**CONFIGS["deepseek_v3"], "score_func": "tanh"}, "score_func"),
        ({**CONFIGS["uniform"], "top_k": 2}, "top_k"),
        ({**CONFIGS["specdrop"], "variant": "dropout"}, "variant"),
        ({**CONFIGS["branch"], "gar": {"lambda": -1}}, "'lambda'"),
        ({**CONFIGS["branch"], "gar": {"lamda": 1}}, "'lamda'"),
        ({**CONFIGS["hash"], "gar": {"lambda": 1}}, "'gar'"),
        ({**CONFIGS["branch"], "gar": {"unit": "sentence"}}, "'sentence'"),
        ({**CONFIGS["branch"], "gar": {"mode": "dense"}}, "'dense'"),
        ({**CONFIGS["switch"], "normalize_gates": "yes"}, "'normalize_gates'"),
        ({**CONFIGS["branch"], "hidden_size": 0}, "hidden_size"),
        ({**CONFIGS["switch"], "hidden_size": -1}, "hidden_size"),
        ({**CONFIGS["switch"], "aux_loss_coeff": -1.0}, "aux_loss_coeff"),
        ({**CONFIGS["switch"], "aux_loss_coeff": float("nan")}, "aux_loss_coeff"),
        ({**CONFIGS["switch"], "node_limit": 0}, "node_limit"),
    ],
)
def test_bad_config_names_the_key(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_router(cfg)


@pytest.mark.parametrize("name", ["switch", "branch", "deepseek_v3", "skywork", "hash", "specdrop"])
def test_bad_inputs(name):
    router = build_router(CONFIGS[name])
    cats = torch.zeros(T, dtype=torch.long)
    with pytest.raises(ValueError, match="shape"):
        router(torch.randn(2, T, H), categories=cats)
    x = torch.randn(T, H)
    x[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        router(x, categories=cats)
    if getattr(router, "hidden_size", None):
        with pytest.raises(ValueError, match="hidden"):
            router(torch.randn(T, H + 1), categories=cats)


def test_nan_never_reaches_router_state():
    branch = build_router(CONFIGS["branch"]).train()
    ds = build_router(CONFIGS["deepseek_v3"]).train()
    x = torch.randn(T, H)
    branch(x), ds(x)
    anchors, bias = branch.anchors.clone(), ds.expert_bias.clone()
    x[0, 0] = float("inf")
    for r in (branch, ds):
        with pytest.raises(ValueError):
            r(x)
    assert torch.equal(branch.anchors, anchors) and torch.equal(ds.expert_bias, bias)


def test_numpy_ints_and_layer_arguments():
    import numpy as np

    from dist_moe import MoELayer

    r = build_router({**CONFIGS["branch"], "num_experts": np.int64(8), "top_k": np.int64(2)})
    assert r.num_experts == 8 and isinstance(r.num_experts, int)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoELayer(H, 16, CONFIGS["switch"], capacity_factor="1.0")
    with pytest.raises(ValueError, match="capacity is set twice"):  # the router's own and the layer's
        MoELayer(H, 16, CONFIGS["switch_capacity"], capacity_factor=1.0)
    MoELayer(H, 16, CONFIGS["switch_capacity"])  # the router's alone is fine
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        MoELayer(H, 0, CONFIGS["switch"])
    with pytest.raises(ValueError, match="token_ids"):
        build_router(CONFIGS["hash"])(torch.randn(3, H), token_ids=torch.tensor([0.5, 1.0, 2.0]))


LEARNED = {"switch": {"type": "switch", "hidden_size": 16, "num_experts": 8, "top_k": 2, "jitter_eps": 0.0},
           "deepseek_v3": {"type": "deepseek_v3", "hidden_size": 16, "num_experts": 8, "top_k": 2},
           "skywork": {"type": "skywork", "hidden_size": 16, "num_experts": 8, "top_k": 2},
           "branch": {"type": "branch", "hidden_size": 16, "num_experts": 8, "top_k": 2},
           "branch_mlp": {"type": "branch", "hidden_size": 16, "num_experts": 8, "top_k": 2, "node_map": "mlp",
                          "mlp_hidden": 4}}


@pytest.mark.parametrize("kind", sorted(LEARNED))
def test_routing_under_bf16_autocast_selects_the_fp32_experts(kind):
    torch.manual_seed(0)
    router = build_router(LEARNED[kind]).eval()
    x = torch.randn(512, 16)
    want = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router(x)
    assert torch.equal(got.expert_idx, want.expert_idx)
    assert got.gates.dtype == torch.float32 and torch.allclose(got.gates, want.gates)


def test_a_bf16_cast_keeps_router_state_in_its_own_precision():
    """.bfloat16() casts weights, never the state buffers: after 300 training forwards a cast BRANCH
    router's anchors and a cast DeepSeek-V3 router's biases equal an fp32 twin's with the same
    (bf16-rounded) weights, and SpecDrop's float64 progress stays float64."""
    torch.manual_seed(0)
    for cfg, state in ((LEARNED["branch"], "anchors"), (LEARNED["deepseek_v3"], "expert_bias")):
        cast = build_router(cfg).bfloat16()
        twin = build_router(cfg)
        twin.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in cast.state_dict().items()})
        assert getattr(cast, state).dtype == torch.float32
        for step in range(300):
            x = torch.randn(64, 16) * 3 + step % 7
            cast(x.bfloat16())
            twin(x.bfloat16().float())
        assert torch.equal(getattr(cast, state), getattr(twin, state)), state
    spec = build_router({"type": "specdrop", "num_experts": 4, "num_categories": 4, "warmup_fraction": 0.5})
    spec.set_progress(0.123456789)
    spec.bfloat16()
    assert spec.progress.dtype == torch.float64 and float(spec.progress) == 0.123456789


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_router_shape_is_the_built_routers_without_building_it(kind):
    """Hosts size their layers from router_shape (no probe build): the same numbers as the router."""
    from dist_moe.routing.registry import router_shape

    cfg = {"hidden_size": H, **CONFIGS[kind]}
    router = build_router(cfg)
    shape = router_shape(cfg)
    assert (shape.num_experts, shape.top_k, shape.aux_loss_coeff) == (
        router.num_experts, router.top_k, float(getattr(router, "aux_loss_coeff", 0.0)))
    for key, bad in (("num_experts", 0), ("top_k", router.num_experts + 1)):
        with pytest.raises(ValueError, match=key):
            build_router({**cfg, key: bad})
        with pytest.raises(ValueError, match=key):  # refused as the build refuses it, before any placement
            router_shape({**cfg, key: bad})
