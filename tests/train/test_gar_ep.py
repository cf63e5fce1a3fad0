"""GAR under expert parallelism: 2 and 4 ranks equal one process running the union of the groups,
for every observation unit and both the materialized and the Gram form, pipelined or not, with
lambda set by a gradient share, and with groups of which some ranks hold no example."""
import pytest

from tests.support.dist_utils import run_cases


def _gar_worker(rank, world, router_type, mode="materialized", unit="group", chunks=1, share=None, empty=False):
    import copy

    import torch
    import torch.distributed as dist

    from dist_moe.models import MoERegressor
    from dist_moe.train.step.gar_step import equal_task_weights, gar_train_step
    from placement import Placement, Topology

    H, E = 6, 4 * world // 2 if world > 2 else 4
    cfg = {"type": router_type, "num_experts": E, "top_k": 2}
    if router_type in ("switch", "skywork"):
        cfg["jitter_eps"] = 0.0

    torch.manual_seed(0)
    ref = MoERegressor(4, H, 8, cfg)
    placement = Placement.round_robin(E, world)
    topo = Topology(("node", "gpu"), (2, world // 2))

    def expert_parallel_copy():  # a process group cannot be deep-copied: build, then load the weights
        ep = MoERegressor(4, H, 8, cfg, group=dist.group.WORLD, placement=placement, topology=topo, dedup="node",
                          pipeline_chunks=chunks)
        ep.load_state_dict({k: v for k, v in ref.state_dict().items() if ".experts." not in k}, strict=False)
        for name, p in ep.moe.experts.named_parameters():
            p.data.copy_(getattr(ref.moe.experts, name).data[ep.moe.local_expert_ids])
        return ep

    # 3 tasks x 2 groups; rank r holds 2 + r examples of every group (with ``empty``, none of every
    # group m with m % world == r: its part is empty, as same-task groups over ranks often are), the
    # reference their union
    g = torch.Generator().manual_seed(1)
    tasks, union, local, sizes = [], [], [], []
    for t in range(3):
        w = torch.randn(4, generator=g)
        for i in range(2):
            m = 2 * t + i
            # example and token units run on sequences of 3 tokens (one token per example otherwise)
            shape = (3, 4) if unit != "group" else (4,)
            parts = [torch.randn(0 if empty and m % world == r else 2 + r, *shape, generator=g) + t
                     for r in range(world)]
            x = torch.cat(parts)
            union.append((x, x @ w))
            local.append((parts[rank], parts[rank] @ w))
            sizes.append(len(parts[rank]))
            tasks.append(t)
    weights = equal_task_weights(tasks, [len(x) for x, _ in union])

    def loss_fn(model, group):
        pred, _ = model(group[0])
        return ((pred - group[1]) ** 2).mean() if len(pred) else pred.sum() * 0.0

    class Record(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            self.seen = [p.grad.clone() for grp in self.param_groups for p in grp["params"]]

    for clip in (None, 0.05):
        r_model, e_model = copy.deepcopy(ref), expert_parallel_copy()
        r_opt, e_opt = Record(r_model.parameters()), Record(e_model.parameters())
        kw = {"lam": 50.0, "max_grad_norm": clip, "mode": mode, "unit": unit, "share": share}
        out_r = gar_train_step(r_model, union, loss_fn, r_opt, weights, **kw)
        out_e = gar_train_step(e_model, local, loss_fn, e_opt, weights, sizes=sizes, **kw)
        # a share: the lambda the summed gradients set, the same on every rank as in one process
        assert abs(out_r["lambda"] - out_e["lambda"]) < 1e-5 * out_r["lambda"]
        assert abs(out_r["gar_loss"] - out_e["gar_loss"]) < 1e-5 * (1 + abs(out_r["gar_loss"]))
        assert abs(out_r["task_loss"] - out_e["task_loss"]) < 1e-5
        if clip is not None:
            assert abs(out_r["grad_norm"] - out_e["grad_norm"]) < 1e-5 * out_r["grad_norm"]
        names = [n for n, _ in r_model.named_parameters()]
        ref_grads = dict(zip(names, r_opt.seen))
        for (name, _p), grad in zip(e_model.named_parameters(), e_opt.seen):
            expected = ref_grads[name]
            if ".experts." in name:
                expected = expected[e_model.moe.local_expert_ids]
            assert torch.allclose(grad, expected, atol=1e-5), (router_type, mode, unit, clip, name)
        router = [n for n in names if ".router." in n]
        assert router and all(ref_grads[n].abs().sum() > 0 for n in router)


# 2 ranks: every router and every unit and form; 4 ranks: branch, and switch with the Gram form.
# (router_type, mode, unit, chunks[, share[, empty parts]]); the cases of one world share one set of ranks.
CASES = {
    2: [("branch", "materialized", "group", 1), ("switch", "materialized", "group", 1),
        ("deepseek_v3", "materialized", "group", 1), ("skywork", "materialized", "group", 1),
        ("switch", "gram", "group", 1), ("branch", "materialized", "example", 1),
        ("branch", "gram", "token", 3),  # pipelined: factors and their row tags captured chunk by chunk
        ("deepseek_v3", "materialized", "token", 1),
        ("switch", "materialized", "group", 1, 0.3),  # lambda from train.gar.share
        ("switch", "materialized", "group", 1, None, True),  # a rank's part of a group empty
        ("branch", "gram", "example", 1, None, True), ("switch", "materialized", "token", 1, None, True)],
    4: [("branch", "materialized", "group", 1), ("switch", "gram", "example", 2),
        ("deepseek_v3", "materialized", "group", 1, 0.3, True)],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_gar_expert_parallel_equals_single_process_for_every_unit_and_form(world):
    run_cases(world, [(_gar_worker, *case) for case in CASES[world]], timeout=240)
