"""GAR observation units finer than groups (appendix G.2): examples and tokens, both modes."""
import copy

import pytest
import torch
from torch import nn

from dist_moe import MoELayer
from dist_moe.gar.observe import collect_observations
from dist_moe.train.step.gar_step import equal_task_weights, gar_objective, gar_train_step

H, S = 6, 4


class SeqMoE(nn.Module):
    """Sequences [B, S, 4] with padding -> MoE per token -> masked mean -> one scalar per example."""

    def __init__(self, router: dict, expert_type: str = "swiglu"):
        super().__init__()
        self.inp = nn.Linear(4, H)
        self.moe = MoELayer(H, 8, dict(router), expert_type=expert_type)
        self.head = nn.Linear(H, 1)

    def forward(self, x, padding):
        h, aux = self.moe(torch.relu(self.inp(x)), padding_mask=padding)
        valid = (~padding).unsqueeze(-1).float()
        pooled = (h * valid).sum(1) / valid.sum(1).clamp_min(1)
        return self.head(pooled).squeeze(-1), aux


def per_example_losses(model, group):
    x, padding, y = group
    pred, _ = model(x, padding)
    return (pred - y) ** 2


def loss_fn(model, group):
    return per_example_losses(model, group).mean()


def make_groups():
    g = torch.Generator().manual_seed(3)
    groups, tasks = [], []
    for t, n in enumerate((3, 4, 3)):
        x = torch.randn(n, S, 4, generator=g) + t
        lengths = torch.randint(1, S + 1, (n,), generator=g)
        padding = torch.arange(S).unsqueeze(0) >= lengths.unsqueeze(1)
        groups.append((x, padding, x.sum((1, 2))))
        tasks.append(t)
    return groups, equal_task_weights(tasks, [len(grp[0]) for grp in groups])


def direct_example_gradients(model, groups):
    """Row per example: its own loss's expert gradients summed over experts (the common template)."""
    rows = []
    for group in groups:
        fresh = copy.deepcopy(model)
        params = list(fresh.moe.experts.template().values())
        losses = per_example_losses(fresh, group)
        for loss in losses:
            grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).sum(0).flatten()
                                   for g, p in zip(grads, params)]))
    return torch.stack(rows)


@pytest.mark.parametrize("expert_type", ["swiglu", "lora"])
def test_example_and_token_observations_are_the_units_own_gradients(expert_type):
    torch.manual_seed(0)
    model = SeqMoE({"type": "branch", "num_experts": 4, "top_k": 2}, expert_type)
    if expert_type == "lora":
        nn.init.normal_(model.moe.experts.lora_B, std=0.3)
    groups, weights = make_groups()
    expected = direct_example_gradients(model, groups)
    ex = collect_observations(copy.deepcopy(model), groups, loss_fn, weights, unit="example")
    assert ex.G[0].shape == expected.shape == (10, expected.shape[1])
    assert torch.allclose(ex.G[0], expected, atol=1e-5)
    # token units: one row per valid token; an example's tokens sum to its own gradient
    tok = collect_observations(copy.deepcopy(model), groups, loss_fn, weights, unit="token")
    owner = torch.cat([torch.arange(len(p)).repeat_interleave(S).reshape(len(p), S)[~p] + sum(
        len(q[1]) for q in groups[:i]) for i, (_, p, _) in enumerate(groups)])
    n_valid = sum(int((~p).sum()) for _, p, _ in groups)
    assert tok.G[0].shape[0] == n_valid
    summed = torch.zeros_like(expected).index_add_(0, owner, tok.G[0])
    assert torch.allclose(summed, expected, atol=1e-5)


@pytest.mark.parametrize("unit", ["group", "example", "token"])
def test_gram_form_equals_materialized_for_every_unit(unit):
    torch.manual_seed(1)
    model = SeqMoE({"type": "switch", "num_experts": 4, "top_k": 2, "jitter_eps": 0.0})
    groups, weights = make_groups()
    mat = collect_observations(copy.deepcopy(model), groups, loss_fn, weights, "materialized", unit=unit)
    gram = collect_observations(copy.deepcopy(model), groups, loss_fn, weights, "gram", unit=unit)
    G = mat.G[0].double()  # float32 observations: compare at float32 precision of the largest entry
    W = G @ G.t()
    assert torch.allclose(gram.W[0], W, rtol=1e-5, atol=1e-6 * float(W.abs().max()))
    assert torch.allclose(gar_objective(mat), gar_objective(gram), rtol=1e-5)


def test_unit_rows_pair_summaries_with_observations():
    """p rows: per example the mean gate over its valid tokens; per token its own gate row."""
    torch.manual_seed(2)
    model = SeqMoE({"type": "switch", "num_experts": 4, "top_k": 2, "jitter_eps": 0.0})
    groups, weights = make_groups()
    from dist_moe.gar.observe import router_summary

    for unit in ("example", "token"):
        obs = collect_observations(copy.deepcopy(model), groups, loss_fn, weights, unit=unit)
        P = obs.route_summaries(0)
        assert P.shape[0] == obs.G[0].shape[0]
        assert torch.allclose(P.sum(1), torch.ones(P.shape[0]))
        h, extras, (shape, padding) = obs.router_inputs[0][0]
        with obs.layers[0].router.frozen_state():
            rows = router_summary(obs.layers[0].router(h, **extras)).reshape(*shape, -1)
        first = rows[0][~padding[0]]
        expected = first.mean(0) if unit == "example" else first[0]
        assert torch.allclose(P[0], expected, atol=1e-6)


def test_train_step_with_token_units_moves_only_the_router_by_the_aux_loss():
    torch.manual_seed(0)
    model = SeqMoE({"type": "switch", "num_experts": 4, "top_k": 2, "jitter_eps": 0.0})
    groups, weights = make_groups()
    after = {}
    for lam in (0.0, 10.0):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        out = gar_train_step(m, groups, loss_fn, opt, weights, lam=lam, max_grad_norm=None, mode="gram",
                             unit="token")
        assert out["gar_loss"] < 0
        after[lam] = dict(m.named_parameters())
    for name, p in after[0.0].items():
        moved = not torch.equal(p, after[10.0][name])
        assert moved == (".router." in name), name


def test_bad_unit_is_named():
    model = SeqMoE({"type": "switch", "num_experts": 4, "top_k": 2})
    groups, weights = make_groups()
    with pytest.raises(ValueError, match="'sentence'"):
        collect_observations(model, groups, loss_fn, weights, unit="sentence")
