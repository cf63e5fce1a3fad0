"""GAR's training step with same-task groups over ranks (``train.gar_groups=same_category``): 2
ranks, each holding its rows of one batch in rank order, update the model as one process does on
the whole batch. A rank's part of a group is often empty; in the second batch rank 1 holds no row."""
from tests.support.dist_utils import run_workers


def _step_worker(rank, world):
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from dist_moe.distributed.reductions import all_reduce_sum
    from dist_moe.models.text import TextMoE
    from dist_moe.moe.layer import MoELayer
    from dist_moe.routing.gar import GARConfig
    from dist_moe.train.run_config import TrainConfig
    from dist_moe.train.step.training_step import GARStep
    from placement import Placement

    H, E, classes = 16, 4, (2, 3, 2)
    router = {"type": "switch", "num_experts": E, "top_k": 2, "jitter_eps": 0.0, "aux_loss_coeff": 0.0}
    torch.manual_seed(0)
    ref = TextMoE(MoELayer(H, 32, router, expert_type="lora"), classes, hidden_size=H)
    with torch.no_grad():
        ref.moe.experts.lora_B.normal_()
    ep = TextMoE(MoELayer(H, 32, router, expert_type="lora", group=dist.group.WORLD,
                          placement=Placement.round_robin(E, world)), classes, hidden_size=H)
    state = ref.state_dict()
    ep.load_state_dict({k: v for k, v in state.items() if ".experts." not in k}, strict=False)
    for name, p in ep.moe.experts.named_parameters():
        full = getattr(ref.moe.experts, name).data
        p.data.copy_(full[ep.moe.local_expert_ids] if p.shape != full.shape else full)

    class Record(torch.optim.Optimizer):  # keeps the gradients the step would apply
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            # None (a frozen base, a head no row used) read as zeros: ranks may fill zeros to sum
            self.seen = [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                         for grp in self.param_groups for p in grp["params"]]

    def runtime(r, w, group):
        return SimpleNamespace(rank=r, world=w, group=group, engine=SimpleNamespace(name="torch"),
                               ep_size=w, layout=SimpleNamespace(replicas=1),
                               sum=(lambda t: all_reduce_sum(t, group)) if group is not None else (lambda t: t))

    tcfg = TrainConfig(gar=GARConfig(lam=50.0), gar_groups="same_category", gar_group_size=3, max_grad_norm=0.5)
    g = torch.Generator().manual_seed(2)
    for n, cut in ((17, None), (9, 9)):  # cut: rank 0's rows (None: the batch split evenly)
        x = torch.randn(n, 5, H, generator=g)
        x[:, -1] = 0  # a padding position
        c = torch.randint(0, 3, (n,), generator=g)
        y = torch.stack([torch.randint(0, classes[k], (), generator=g) for k in c.tolist()])
        mine = torch.tensor_split(torch.arange(n), world)[rank] if cut is None else (
            torch.arange(cut) if rank == 0 else torch.arange(cut, n))
        r_opt, e_opt = Record(ref.parameters()), Record(ep.parameters())
        one = GARStep(tcfg, runtime(0, 1, None))(ref, SimpleNamespace(opt=r_opt, finish_external=None), x, y, c)
        many = GARStep(tcfg, runtime(rank, world, dist.group.WORLD))(
            ep, SimpleNamespace(opt=e_opt, finish_external=None), x[mine], y[mine], c[mine])
        assert abs(one["loss"] - many["loss"]) < 1e-5 and abs(one["gar_loss"] - many["gar_loss"]) < 1e-5, (rank, n)
        ref_grads = dict(zip([k for k, _ in ref.named_parameters()], r_opt.seen))
        for (name, _), grad in zip(ep.named_parameters(), e_opt.seen):
            expected = ref_grads[name]
            if ".experts." in name and grad.shape != expected.shape:
                expected = expected[ep.moe.local_expert_ids]
            assert torch.allclose(grad, expected, atol=1e-5), (rank, n, name)


def test_same_task_gar_step_over_ranks_equals_one_process():
    run_workers(_step_worker, 2, timeout=120)
