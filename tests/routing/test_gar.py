"""GAR: the criterion, the paper's examples, the Gram form and the update semantics."""
import copy

import pytest
import torch
from torch import nn

from dist_moe import MoELayer
from dist_moe.gar.observe import collect_observations, example_mean, group_route_summaries
from dist_moe.routing.gar import gar_loss, gar_loss_gram
from dist_moe.train.step.gar_step import equal_task_weights, gar_objective, gar_train_step

H = 6


def test_gar_loss_equals_formula():
    P = torch.softmax(torch.randn(7, 4), -1)
    G = torch.randn(7, 11)
    expected = 0.0
    for k in range(4):
        agg = sum(P[m, k] * G[m] for m in range(7))
        expected -= float(agg @ agg) / (float(P[:, k].sum()) + 1e-3)
    assert abs(float(gar_loss(P, G, eps=1e-3)) - expected) < 1e-4
    assert torch.allclose(gar_loss_gram(P, G @ G.t(), 1e-3), gar_loss(P, G, 1e-3), atol=1e-4)


def test_three_observation_example():
    """Section 3.3: <g1,g2>=0.9, <g1,g3>=<g2,g3>=0.2 -> A_0 = 2.9 for {{1,2},{3}}, 2.2 otherwise."""
    gram = torch.tensor([[1.0, 0.9, 0.2], [0.9, 1.0, 0.2], [0.2, 0.2, 1.0]], dtype=torch.float64)
    G = torch.linalg.cholesky(gram)  # rows are unit vectors with exactly these inner products
    assert torch.allclose(G @ G.t(), gram)
    results = {}
    for pair in [(0, 1), (0, 2), (1, 2)]:
        P = torch.zeros(3, 2, dtype=torch.float64)
        P[list(pair), 0] = 1
        P[[m for m in range(3) if m not in pair], 1] = 1
        results[pair] = -float(gar_loss(P, G, eps=0.0))
    assert abs(results[(0, 1)] - 2.9) < 1e-12
    assert abs(results[(0, 2)] - 2.2) < 1e-12 and abs(results[(1, 2)] - 2.2) < 1e-12


class TwoLayerMoE(nn.Module):
    def __init__(self, router: dict, expert_type="swiglu", **kw):
        super().__init__()
        self.inp = nn.Linear(4, H)
        self.moe1 = MoELayer(H, 8, dict(router), expert_type=expert_type, **kw)
        self.moe2 = MoELayer(H, 8, dict(router), expert_type=expert_type, **kw)
        self.head = nn.Linear(H, 1)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h1, a1 = self.moe1(h)
        h2, a2 = self.moe2(h + h1)
        return self.head(h2).squeeze(-1), a1 + a2


def make_groups(n_tasks=3, per_task=2, size=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups, tasks, sizes = [], [], []
    for t in range(n_tasks):
        w = torch.randn(4, generator=g)
        for _ in range(per_task):
            x = torch.randn(size, 4, generator=g) + t
            groups.append((x, x @ w))
            tasks.append(t)
            sizes.append(size)
    return groups, equal_task_weights(tasks, sizes)


def loss_fn(model, group):
    pred, aux = model(group[0])
    return ((pred - group[1]) ** 2).mean() + aux


ROUTERS = {
    "branch": {"type": "branch", "num_experts": 4, "top_k": 2},
    "switch": {"type": "switch", "num_experts": 4, "top_k": 2, "jitter_eps": 0.0},
    "skywork": {"type": "skywork", "num_experts": 4, "top_k": 2, "jitter_eps": 0.0},
    "deepseek_v3": {"type": "deepseek_v3", "num_experts": 4, "top_k": 2},
}


def router_param_names(model):
    return {n for n, _ in model.named_parameters() if ".router." in n}


class RecordGrads(torch.optim.Optimizer):
    """An optimizer whose step only records the gradients it would apply."""

    def __init__(self, params):
        super().__init__(params, {})
        self.seen = None

    def step(self, closure=None):
        self.seen = [None if p.grad is None else p.grad.clone() for g in self.param_groups for p in g["params"]]


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_aux_gradient_reaches_only_router_parameters(router):
    torch.manual_seed(0)
    model = TwoLayerMoE(ROUTERS[router])
    groups, weights = make_groups()
    names = [n for n, _ in model.named_parameters()]
    grads = {}
    for lam in (0.0, 10.0):
        m = copy.deepcopy(model)
        opt = RecordGrads(m.parameters())
        out = gar_train_step(m, groups, loss_fn, opt, weights, lam=lam, max_grad_norm=None)
        grads[lam] = dict(zip(names, opt.seen))
        assert out["gar_loss"] < 0
    routers = router_param_names(model)
    assert routers
    for n in names:
        if n in routers:
            assert not torch.allclose(grads[0.0][n], grads[10.0][n]), n
        else:
            assert torch.equal(grads[0.0][n], grads[10.0][n]), n


def test_observations_match_direct_per_group_gradients():
    torch.manual_seed(0)
    model = TwoLayerMoE(ROUTERS["branch"])
    groups, weights = make_groups()
    obs = collect_observations(model, groups, loss_fn, weights)
    # task gradient accumulated = sum_m w_m grad l_m
    for m, group in enumerate(groups):
        fresh = copy.deepcopy(model)
        fresh.zero_grad()
        loss_fn(fresh, group).backward()
        for li, layer in enumerate([fresh.moe1, fresh.moe2]):
            direct = torch.cat([p.grad.sum(0).flatten() for p in layer.experts.template().values()])
            assert torch.allclose(obs.G[li][m], direct, atol=1e-5)
    # the template has one slot per stacked parameter: d = sum of one expert's sizes
    d = sum(p[0].numel() for p in model.moe1.experts.template().values())
    assert obs.G[0][0].shape == (d,)


@pytest.mark.parametrize("expert_type", ["swiglu", "gelu", "lora"])
def test_factorized_gram_equals_materialized(expert_type):
    torch.manual_seed(0)
    model = TwoLayerMoE(ROUTERS["branch"], expert_type=expert_type)
    if expert_type == "lora":  # B starts at zero; give it values so the A slot has a gradient too
        for layer in (model.moe1, model.moe2):
            nn.init.normal_(layer.experts.lora_B, std=0.3)
    groups, weights = make_groups()
    mat = collect_observations(copy.deepcopy(model), groups, loss_fn, weights, "materialized")
    gram = collect_observations(copy.deepcopy(model), groups, loss_fn, weights, "gram")
    for li in range(2):
        G = mat.G[li].double()
        W = gram.W[li]
        assert torch.allclose(W, G @ G.t(), rtol=1e-6, atol=1e-8)
        assert float(W.abs().max()) > 0
    assert torch.allclose(gar_objective(mat), gar_objective(gram), rtol=1e-5)


def test_gram_and_materialized_steps_update_identically():
    torch.manual_seed(0)
    model = TwoLayerMoE(ROUTERS["switch"])
    groups, weights = make_groups()
    results = []
    for mode in ("materialized", "gram"):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        gar_train_step(m, groups, loss_fn, opt, weights, lam=5.0, max_grad_norm=1.0, mode=mode)
        results.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert torch.allclose(results[0], results[1], atol=1e-6)


def test_global_clip_and_single_step():
    torch.manual_seed(0)
    model = TwoLayerMoE(ROUTERS["branch"])
    groups, weights = make_groups()
    opt = RecordGrads(model.parameters())
    out = gar_train_step(model, groups, loss_fn, opt, weights, lam=1e3, max_grad_norm=0.5)
    clipped = torch.sqrt(sum((g**2).sum() for g in opt.seen if g is not None))
    assert out["grad_norm"] > 0.5
    assert abs(float(clipped) - 0.5) < 1e-4  # one norm over all parameters together
    # router state moved exactly once per group forward, not again in the recomputation
    assert int(model.moe1.router.ema_step) == len(groups)


def test_equal_task_weights():
    w = equal_task_weights([0, 0, 1], [10, 30, 5])
    assert w == [0.125, 0.375, 0.5]
    assert abs(sum(w) - 1) < 1e-12


@pytest.mark.parametrize("world", [2, 4])
def test_same_task_groups_over_ranks_are_the_groups_of_one_process(world):
    """train.gar_groups=same_category under expert parallelism: each rank's part of every unit, put
    back at its place in the batch, gives the groups one process forms from the whole batch (each
    task's rows in order, runs of g), with the same tasks and sizes on every rank."""
    from dist_moe.train.step.training_step import same_category_units

    g = torch.Generator().manual_seed(3)
    cb = torch.randint(0, 5, (48,), generator=g)
    cb[cb == 3] = 4  # a category no rank holds is no unit
    expected = [rows[i : i + 8].tolist() for c in cb.unique().tolist()
                for rows in [(cb == c).nonzero().squeeze(1)] for i in range(0, len(rows), 8)]
    one = same_category_units(cb, 8, 0, torch.bincount(cb, minlength=5)[None])
    assert [p.tolist() for p in one[1]] == expected and one[2] == [len(r) for r in expected]
    slices = torch.tensor_split(torch.arange(48), world)  # each rank's rows of the batch, as the trainer cuts it
    counts = torch.stack([torch.bincount(cb[rows], minlength=5) for rows in slices])
    units = [same_category_units(cb[rows], 8, r, counts) for r, rows in enumerate(slices)]
    assert all(u[0] == one[0] and u[2] == one[2] for u in units)
    joined = [sorted(i for r, rows in enumerate(slices) for i in rows[units[r][1][m]].tolist())
              for m in range(len(one[0]))]
    assert joined == expected
    assert any(len(units[r][1][m]) == 0 for r in range(world) for m in range(len(one[0])))  # empty parts occur


def test_same_task_groups_over_ranks_are_refused_for_engine_hosted_layers():
    """Empty parts of a group run only through dist-moe's own layer: DeepSpeed and Megatron are refused."""
    from types import SimpleNamespace

    from dist_moe.routing.gar import GARConfig
    from dist_moe.train.run_config import TrainConfig
    from dist_moe.train.step.training_step import GARStep

    def runtime(world, engine):
        return SimpleNamespace(world=world, ep_size=world, layout=SimpleNamespace(replicas=1),
                               engine=SimpleNamespace(name=engine))

    tcfg = TrainConfig(gar=GARConfig(lam=1e-3), gar_groups="same_category")
    for engine, world in (("deepspeed", 2), ("megatron", 4)):
        with pytest.raises(ValueError, match=f"over {world} ranks needs engine=torch, got engine={engine}"):
            GARStep(tcfg, runtime(world, engine))
    GARStep(tcfg, runtime(2, "torch"))
    GARStep(tcfg, runtime(1, "deepspeed"))


def test_gar_reduces_its_criterion_for_the_router():
    """A few router-only updates on L_norm raise the coherence reward on fixed observations."""
    torch.manual_seed(0)
    model = TwoLayerMoE(ROUTERS["switch"])
    groups, weights = make_groups(n_tasks=4, per_task=3)
    obs = collect_observations(model, groups, loss_fn, weights)
    routers = [p for n, p in model.named_parameters() if ".router." in n]
    opt = torch.optim.SGD(routers, lr=0.5)
    values = []
    for _ in range(20):
        opt.zero_grad()
        loss = gar_objective(obs)
        loss.backward()
        opt.step()
        values.append(float(loss.detach()))
    assert values[-1] < values[0]


@pytest.mark.parametrize("router", ["switch", "branch"])
def test_top1_routers_get_a_straight_through_gar_gradient(router):
    """A one-hot top-1 summary has no gradient; the straight-through summary (D.4) does."""
    torch.manual_seed(0)
    model = TwoLayerMoE({**ROUTERS[router], "top_k": 1})
    groups, weights = make_groups()
    obs = collect_observations(model, groups, loss_fn, weights)
    P = group_route_summaries(model.moe1.router, obs.router_inputs[0])
    assert torch.allclose(P.sum(1), torch.ones(len(groups)))
    # value: the mean of one-hot rows (the configured gates); gradient: through the probabilities
    with model.moe1.router.frozen_state():
        idx = model.moe1.router(obs.router_inputs[0][0][0]).expert_idx[:, 0]
    onehot = torch.nn.functional.one_hot(idx, 4).float().mean(0)
    assert torch.allclose(P[0].detach(), onehot)
    model.zero_grad()
    gar_objective(obs).backward()
    grads = [p.grad for n, p in model.named_parameters() if ".router." in n]
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 1e-5  # one-hot alone: ~1e-8 rounding


def test_example_mean_then_group_mean_with_padding():
    summary = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.5, 0.5], [0.0, 1.0], [0.0, 1.0]])
    # two examples of three positions; example 0 pads its last position, example 1 pads nothing
    padding = torch.tensor([[False, False, True], [False, False, False]])
    p = example_mean(summary, ((2, 3), padding))
    q0 = torch.tensor([0.5, 0.5])  # mean of its two valid tokens
    q1 = torch.tensor([0.5 / 3, 2.5 / 3])
    assert torch.allclose(p, (q0 + q1) / 2)
    assert torch.allclose(example_mean(summary, ((6,), None)), summary.mean(0))
    # a fully padded example is left out instead of counting as zeros
    all_pad = torch.tensor([[True, True, True], [False, False, False]])
    assert torch.allclose(example_mean(summary, ((2, 3), all_pad)), q1)


def test_a_share_sets_lambda_so_gar_is_that_fraction_of_the_router_gradient():
    """train.gar.share s: lambda is set so that ||lambda grad_router L_norm|| = s ||grad_router L_task||,
    measured on the same step's gradients; what is added is lambda times L_norm's own gradient, on the
    router parameters alone."""
    torch.manual_seed(0)
    model = TwoLayerMoE(ROUTERS["switch"])
    groups, weights = make_groups()
    names = [n for n, _ in model.named_parameters()]
    routers = router_param_names(model)
    seen, lams = {}, {}
    for key, kw in (("task", {"lam": 0.0}), ("unit", {"lam": 1.0}), (0.1, {"share": 0.1}), (1.0, {"share": 1.0})):
        m = copy.deepcopy(model)
        opt = RecordGrads(m.parameters())
        out = gar_train_step(m, groups, loss_fn, opt, weights, max_grad_norm=None, **{"lam": 0.0, **kw})
        seen[key], lams[key] = dict(zip(names, opt.seen)), out["lambda"]
    flat = lambda key: torch.cat([seen[key][n].flatten() for n in names if n in routers])  # noqa: E731
    task, norm_grad = flat("task"), flat("unit") - flat("task")  # grad L_norm itself (lambda 1)
    for share in (0.1, 1.0):
        added = flat(share) - task
        assert abs(float(added.norm() / task.norm()) - share) < 1e-4, share  # the measured share is s
        assert torch.allclose(added, lams[share] * norm_grad, atol=1e-6, rtol=1e-4)  # lambda grad L_norm
        for n in names:
            if n not in routers:
                assert torch.equal(seen[share][n], seen["task"][n]), n
    assert lams[1.0] == pytest.approx(10 * lams[0.1], rel=1e-6) and lams[0.1] > 0
