"""Load: 150 small steps on 4 ranks with a different batch size every step (some ranks empty):
no memory growth, and the replicated router state identical on every rank at the end."""
from tests.support.dist_utils import run_workers

STEPS = 150  # RSS read every 25 steps; growth measured over the last 100 (250 steps took 36 s of CI's 15 minutes)


def _soak_worker(rank, world, out):
    import hashlib

    import psutil
    import torch
    import torch.distributed as dist

    from dist_moe import MoELayer
    from dist_moe.train.step.steppers import LocalStepper
    from placement import Placement, Topology

    torch.manual_seed(0)
    topo = Topology(("node", "gpu"), (2, 2))
    layer = MoELayer(16, 16, {"type": "branch", "num_experts": 8, "top_k": 2, "subtree_limit": 1},
                     group=dist.group.WORLD,
                     topology=topo, placement=Placement.tree_prefix(8, topo), dedup="node", capacity_factor=1.25)
    head = torch.nn.Linear(16, 1)
    model = torch.nn.ModuleDict({"moe": layer, "head": head})
    stepper = LocalStepper(model, 1e-3, 1.0, dist.group.WORLD, world)
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own batch sizes and data
    proc = psutil.Process()
    rss = []
    for step in range(STEPS):
        n = int(torch.randint(0, 48, (1,), generator=gen))  # 0 to 47 rows: empty batches included
        x = torch.randn(n, 16, generator=gen)
        y, aux = layer(x)
        loss = (head(y).square().mean() if n else head(y).sum() * 0.0) + aux
        assert not stepper(loss), step  # not skipped
        if step % 25 == 0:
            rss.append(proc.memory_info().rss)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("moe.experts.")}  # replicated part
    digest = hashlib.sha256(b"".join(state[k].detach().contiguous().numpy().tobytes() for k in sorted(state)))
    digests = [None] * world
    dist.all_gather_object(digests, digest.hexdigest())
    assert len(set(digests)) == 1, digests  # BRANCH anchors, EMA step, balance bias, router and head weights agree
    growth = (rss[-1] - rss[2]) / 2**20  # after the first 50 steps' warm-up
    grown = torch.tensor([growth])
    dist.all_reduce(grown, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{STEPS} {rss[2] / 2**20:.1f} {rss[-1] / 2**20:.1f} {float(grown):.2f} {digests[0][:16]}\n")
    assert float(grown) < 8.0, f"RSS grew {float(grown):.1f} MiB over {STEPS - 50} steps"


def test_soak_no_memory_growth_no_replica_drift(tmp_path):
    out = tmp_path / "soak.txt"
    run_workers(_soak_worker, 4, args=(str(out),), timeout=600)
    steps, start, end, grown, digest = out.read_text().split()
    print(f"\nsoak: {steps} steps on 4 ranks; rank 0 RSS {start} -> {end} MiB; max growth over ranks {grown} MiB; "
          f"replicated state sha256 {digest}... on every rank")
