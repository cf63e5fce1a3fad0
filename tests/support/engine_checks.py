"""Engine-hosted layers against dist-moe's own expert-parallel layer, inside gloo workers.

Same router and expert weights, same tokens on each rank: outputs, aux losses,
input gradients, router gradients and expert gradients must agree.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dist_moe import MoELayer
from placement import Placement
from tests.support.ep_checks import ROUTERS

H, F, E, T = 8, 12, 8, 13


def reference_layer(router: str, placement: Placement) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(H, F, dict(ROUTERS[router]), placement=placement, group=dist.group.WORLD, dedup="rank")


def rank_inputs(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g)
    cats = torch.randint(0, 5, (T,), generator=g)
    ids = (torch.arange(T) + rank * T) * 7919
    w = torch.randn(T, H, generator=g)
    return x, cats, ids, w


def compare(tag: str, ref: MoELayer, y_ref, aux_ref, x_ref, y, aux, x, router, experts_by_slot) -> None:
    """``experts_by_slot[j]``: name -> engine parameter of this rank's j-th local expert."""
    assert torch.allclose(y, y_ref, atol=1e-5), f"{tag}: outputs differ"
    assert torch.allclose(aux, aux_ref, atol=1e-6), f"{tag}: aux losses differ"
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5), f"{tag}: input gradients differ"
    for (name, p_ref), p in zip(ref.router.named_parameters(), router.parameters()):
        assert torch.allclose(p.grad, p_ref.grad, atol=1e-5), f"{tag}: router gradient {name} differs"
    for name, p_ref in ref.experts.named_parameters():
        for j, params in enumerate(experts_by_slot):
            g = params[name].grad
            g = torch.zeros_like(params[name]) if g is None else g
            assert torch.allclose(g.reshape(p_ref.shape[1:]), p_ref.grad[j], atol=1e-5), \
                f"{tag}: expert {ref.local_expert_ids[j]} gradient {name} differs"


GAR_HIDDEN = 6
GAR_KW = {"lam": 50.0, "max_grad_norm": None}


class Record(torch.optim.Optimizer):
    """An optimizer whose step records the gradients it would apply, by parameter id."""

    def __init__(self, params, lr=0.0):
        super().__init__(params, {"lr": lr})
        self.seen = {}

    def step(self, closure=None):
        self.seen = {id(p): p.grad.clone() for grp in self.param_groups for p in grp["params"]}


class GARNet(torch.nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.inp, self.moe, self.head = torch.nn.Linear(4, GAR_HIDDEN), moe, torch.nn.Linear(GAR_HIDDEN, 1)

    def forward(self, x):
        h, aux = self.moe(torch.relu(self.inp(x)))
        return self.head(h).squeeze(-1), aux


class GARCase:
    """One GAR step on dist-moe's EP layer (the reference) and the checks a hosted copy must pass."""

    def __init__(self, rank: int, world: int, even: bool = False):
        """``even``: every rank holds 3 examples per group (Megatron's allgather dispatcher needs
        equal token counts on every rank); otherwise rank r holds 2 + r."""
        from dist_moe.train.step.gar_step import equal_task_weights, gar_train_step

        # no aux loss: Megatron adds it inside the output's backward, the loss_fn here leaves it out
        self.router = {"type": "switch", "num_experts": 4, "top_k": 2, "jitter_eps": 0.0, "aux_loss_coeff": 0.0}
        self.placement = Placement.round_robin(4, world)
        self.net = GARNet
        torch.manual_seed(0)
        self.ref = GARNet(MoELayer(GAR_HIDDEN, 8, dict(self.router), placement=self.placement,
                                   group=dist.group.WORLD))
        g = torch.Generator().manual_seed(1)
        self.groups, tasks, self.sizes = [], [], []
        for t in range(3):
            w = torch.randn(4, generator=g)
            for _ in range(2):
                parts = [torch.randn(3 if even else 2 + r, 4, generator=g) + t for r in range(world)]
                self.groups.append((parts[rank], parts[rank] @ w))
                self.sizes.append(len(parts[rank]))
                tasks.append(t)
        self.weights = equal_task_weights(tasks, [sum(len(p) for p in parts)] * len(self.groups))
        self.opt = Record(self.ref.parameters())
        self.out = gar_train_step(self.ref, self.groups, self.loss_fn, self.opt, self.weights, sizes=self.sizes,
                                  **GAR_KW)

    @staticmethod
    def loss_fn(model, group):
        pred, _ = model(group[0])
        return ((pred - group[1]) ** 2).mean()

    def copy_dense(self, hosted) -> None:
        hosted.inp.load_state_dict(self.ref.inp.state_dict())
        hosted.head.load_state_dict(self.ref.head.state_dict())
        hosted.moe.router.load_state_dict(self.ref.moe.router.state_dict())

    def check(self, tag, out, seen, hosted, expert_grad) -> None:
        """``expert_grad(name, j)``: the hosted gradient of local expert j in dist-moe's slot layout."""
        assert abs(self.out["gar_loss"] - out["gar_loss"]) < 1e-5 * (1 + abs(self.out["gar_loss"])), tag
        assert abs(self.out["task_loss"] - out["task_loss"]) < 1e-6, tag
        ref = self.ref
        pairs = [(ref.inp.weight, hosted.inp.weight), (ref.head.weight, hosted.head.weight)]
        pairs += list(zip(ref.moe.router.parameters(), hosted.moe.router.parameters()))
        for a, b in pairs:
            assert torch.allclose(self.opt.seen[id(a)], seen[id(b)], atol=1e-5), (tag, tuple(a.shape))
        assert any(self.opt.seen[id(p)].abs().sum() > 0 for p in ref.moe.router.parameters())
        for name, p in ref.moe.experts.named_parameters():
            for j in range(p.shape[0]):
                assert torch.allclose(expert_grad(name, j), self.opt.seen[id(p)][j], atol=1e-5), (tag, name, j)


def gar_case(rank: int, world: int, even: bool = False) -> GARCase:
    return GARCase(rank, world, even)
