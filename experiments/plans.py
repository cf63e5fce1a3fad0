"""The grid of each experiment: run ids, the labels tables group by, and config overrides.

Every run is a `dist-moe train` config (defaults + overrides). Steps are shrunk to
fit 2 CPU cores; the shrink is the same for every arm of a table.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DATASETS = {"magic": "HIGGS-like (binary)", "letter": "multi-class (26)", "satimage": "multi-class (6)"}
SIGN_BALANCE = ["router.balance_rule=sign", "router.balance_eval=false"]
ROUTER_ARMS = {  # arm: router overrides
    "branch_linear": ["router.type=branch", "router.node_map=linear"],
    "branch_mlp4": ["router.type=branch", "router.node_map=mlp", "router.mlp_hidden=4"],
    "branch_mlp8": ["router.type=branch", "router.node_map=mlp", "router.mlp_hidden=8"],
    "switch": ["router.type=switch"],
    "deepseek_v3": ["router.type=deepseek_v3"],
    "skywork": ["router.type=skywork"],
    "hash": ["router.type=hash"],
    # told the node boundary: BRANCH's subtree limit (its top-level decision is the node, under
    # tree-prefix placement) and DeepSeek-V3's node-limited routing, M=1. `_limit1` is the limit
    # unbalanced (its results predate subtree_balance); `_bal` the sign-rule balance its results
    # ran (the default rule since is newton, with evaluation's own bias: benchmarks/balance.py)
    "branch_linear_limit1": ["router.type=branch", "router.node_map=linear", "router.subtree_limit=1",
                             "router.subtree_balance=none"],
    "branch_mlp4_limit1": ["router.type=branch", "router.node_map=mlp", "router.mlp_hidden=4",
                           "router.subtree_limit=1", "router.subtree_balance=none"],
    "branch_linear_limit1_bal": ["router.type=branch", "router.node_map=linear", "router.subtree_limit=1",
                                 "router.subtree_balance=bias", *SIGN_BALANCE],
    "branch_mlp4_limit1_bal": ["router.type=branch", "router.node_map=mlp", "router.mlp_hidden=4",
                               "router.subtree_limit=1", "router.subtree_balance=bias", *SIGN_BALANCE],
    "deepseek_v3_node1": ["router.type=deepseek_v3", "router.node_limit=1"],
}


@dataclass
class Plan:
    name: str
    # "ranks": torchrun on loopback, each run's ``ranks`` (4: as 2 nodes x 2); "single": one process;
    # "emulated": emulate_cluster
    launch: str
    runs: list = field(default_factory=list)
    after: str | None = None
    post: str | None = None
    before: str | None = None  # run once per launch on every rank, before the runs (e.g. link calibration)
    rate: str = "400mbit"  # the emulated inter-node link

    def add(self, run_id: str, labels: dict, overrides: list[str], config: str | None = None,
            ranks: int = 4) -> None:
        if ranks != 1 and ranks % 2:  # the launcher accounts ranks as nodes of 2
            raise ValueError(f"{run_id}: ranks must be 1 or even, got {ranks}")
        self.runs.append({"id": run_id, "labels": labels, "config": config, "ranks": ranks,
                          # a run not in the results is trained afresh: a killed attempt's files go first
                          "overrides": [f"name={run_id}", f"output.dir=experiments/runs/{self.name}/{run_id}",
                                        "output.overwrite=true", *overrides]})


def run_placement(arm: str) -> str:
    """BRANCH trains on tree-prefix placement (its subtrees are the nodes), flat routers on contiguous."""
    return "tree_prefix" if arm.startswith("branch") else "contiguous"


def routers(seeds=range(5), steps: int = 240) -> Plan:
    """BRANCH-MoE (linear, MLP h=4, h=8 node maps; unlimited and subtree-limited) against the flat
    routers (unlimited, and DeepSeek-V3 node-limited); E=16, top-4, cf 1.25."""
    plan = Plan("routers", "ranks", post="post_routing_bytes")
    for data in DATASETS:
        for arm, router in ROUTER_ARMS.items():
            placement = run_placement(arm)
            for seed in seeds:
                plan.add(f"{data}-{arm}-s{seed}", {"dataset": data, "arm": arm, "seed": seed},
                         [f"seed={seed}", f"data.name={data}", *router, "router.num_experts=16", "router.top_k=4",
                          "model.capacity_factor=1.25", "model.expert_type=swiglu", "model.ffn_hidden_size=32",
                          f"parallel.placement={placement}", "parallel.dedup=node", f"train.max_steps={steps}",
                          "train.batch_size=64", "train.lr=0.003", "train.log_every=40"])
    return plan


SPECDROP_ARMS = {  # arm: router / model overrides (the configs/tabular_specdrop*.yaml family)
    "specdrop_soft": ["router.variant=soft", "router.p_assigned=0.7"],
    "no_routing": ["router.variant=uniform"],
    "hard_category": ["router.variant=hard", "router.p_assigned=1.0"],
    "dense_labelmask": ["router.variant=uniform", "model.label_mask=true"],
}
SPECDROP_SETS = {  # aligned partitions: every example carries one clean category
    "fashion_mnist": ("configs/image_specdrop.yaml", ["data.max_rows=20000", "train.epochs=3"]),
    "wordnet_glosses": (None, ["data.name=wordnet_glosses", "data.categories=wordnet_pos", "router.type=specdrop",
                               "router.num_experts=4", "router.num_categories=4", "model.ffn_hidden_size=64",
                               "train.epochs=8", "train.batch_size=32", "train.lr=0.001"]),
}


def specdrop(seeds=range(3), lm_steps: int = 150) -> Plan:
    """SpecDrop against No-Routing, HardCategory and dense + logit masking on aligned partitions
    (Fashion-MNIST superclasses, WordNet parts of speech), and on the multi-domain LM (fuzzy)."""
    plan = Plan("specdrop", "ranks", after="after_masking")
    for data, (config, base) in SPECDROP_SETS.items():
        for arm, overrides in SPECDROP_ARMS.items():
            for seed in seeds:
                plan.add(f"{data}-{arm}-s{seed}", {"dataset": data, "arm": arm, "seed": seed},
                         [f"seed={seed}", *base, *overrides, "train.log_every=50"], config)
    for arm in ("specdrop_soft", "no_routing", "hard_category"):  # no label space to mask in an LM
        for seed in seeds:
            plan.add(f"lm-{arm}-s{seed}", {"dataset": "lm_domains", "arm": arm, "seed": seed},
                     [f"seed={seed}", "data.categories=domains", "data.per_domain=500", f"train.max_steps={lm_steps}",
                      "router.type=specdrop", "router.num_experts=4", "router.num_categories=4",
                      *SPECDROP_ARMS[arm], "parallel.placement=contiguous", "parallel.dedup=node",
                      "train.log_every=50"], "configs/lm_branch.yaml")
    return plan


GAR_ARMS = {  # arm: (gar lambda, switch aux-loss coefficient, gar share)
    "task_only": (0.0, 0.0, None),
    "switch_aux": (0.0, 0.01, None),
    "gar_1e-4": (1e-4, 0.0, None),
    "gar_1e-3": (1e-3, 0.0, None),
    "gar_1e-2": (1e-2, 0.0, None),
    # beyond the grid: here GAR's gradient is <= 1.5% of the router's at lambda 1e-2 (measured),
    # so larger coefficients show whether the objective does anything at a comparable share
    "gar_1e-1": (1e-1, 0.0, None),
    "gar_1": (1.0, 0.0, None),
    # lambda set every step so that GAR's router gradient is this share of the task loss's (train.gar.share)
    "gar_share_0.1": (None, 0.0, 0.1),
    "gar_share_0.3": (None, 0.0, 0.3),
    "gar_share_1": (None, 0.0, 1.0),
}


# the arms whose accuracy question gets 10 more seeds: task-only, the two shares and the fixed
# lambda that moved purity
GAR_MORE_SEEDS = ("task_only", "gar_1", "gar_share_0.3", "gar_share_1")


def gar(seeds=range(10), more_seeds=range(10, 20)) -> Plan:
    """GAR against task-loss-only routing and the Switch aux loss on the five-task text mixture
    (frozen MiniLM, LoRA experts, E8K4, same-task groups of 8), one process (``gar_ep``: the
    same arms over 2 and 4 ranks); the ``GAR_MORE_SEEDS`` arms also run ``more_seeds``."""
    plan = Plan("gar", "single", after="after_gar_diagnostics")
    for arm, (lam, aux, share) in GAR_ARMS.items():
        for seed in [*seeds, *(more_seeds if arm in GAR_MORE_SEEDS else ())]:
            plan.add(f"text-{arm}-s{seed}", {"arm": arm, "lambda": lam, "aux": aux, "share": share, "seed": seed},
                     _gar_overrides(arm, seed), "configs/text_gar.yaml")
    return plan


def _gar_overrides(arm: str, seed: int) -> list[str]:
    lam, aux, share = GAR_ARMS[arm]
    coefficient = [f"train.gar.lambda={lam}"] if share is None else ["train.gar.lambda=null",
                                                                       f"train.gar.share={share}"]
    return [f"seed={seed}", *coefficient, f"router.aux_loss_coeff={aux}"]


# the arms the expert-parallel GAR runs repeat: the baselines, every share, the best fixed lambda
GAR_EP_ARMS = ("task_only", "switch_aux", "gar_1", "gar_share_0.1", "gar_share_0.3", "gar_share_1")


def gar_ep(seeds=range(10), seeds_at_4: int = 5) -> Plan:
    """``gar``'s arms with the experts over 2 and 4 ranks (GAR's sharded path): the same global
    batch of 48 (24 or 12 rows per rank), same-task groups formed over every rank's rows, the
    diagnostics reduced over the ranks; compared seed by seed with the one-process runs. 4 ranks
    (twice as slow on 2 cores) run the first ``seeds_at_4`` seeds."""
    plan = Plan("gar_ep", "ranks", after="after_gar_diagnostics")
    batch = 48  # configs/text_gar.yaml's train.batch_size: one process's batch, cut over the ranks
    for ranks, ranks_seeds in ((2, list(seeds)), (4, list(seeds)[:seeds_at_4])):
        for arm in GAR_EP_ARMS:
            lam, aux, share = GAR_ARMS[arm]
            for seed in ranks_seeds:
                plan.add(f"text-ep{ranks}-{arm}-s{seed}",
                         {"arm": arm, "lambda": lam, "aux": aux, "share": share, "seed": seed, "ranks": ranks},
                         [*_gar_overrides(arm, seed), f"train.batch_size={batch // ranks}"], "configs/text_gar.yaml",
                         ranks=ranks)
    return plan


def throughput(seeds=(0,), steps: int = 100) -> Plan:
    """Tokens/s of the tiny MoE LM on 2 emulated nodes x 2 (400 mbit inter-node link, about 10x
    slower than intra-node) per router x placement x dedup. E=8 top-2: tree-prefix and contiguous
    placement coincide on 2 x 2 ranks, so round-robin is the other placement."""
    plan = Plan("throughput", "emulated", before="before_calibrate", after="after_exchange_time",
                post="post_step_prediction")
    for router in ("switch", "branch"):
        for placement in ("tree_prefix" if router == "branch" else "contiguous", "round_robin"):
            for dedup in ("none", "rank", "node"):
                for seed in seeds:
                    plan.add(f"lm-{router}-{placement}-{dedup}-s{seed}",
                             {"router": router, "placement": placement, "dedup": dedup, "seed": seed},
                             [f"seed={seed}", f"router.type={router}", f"parallel.placement={placement}",
                              f"parallel.dedup={dedup}", f"train.max_steps={steps}", "data.per_domain=500",
                              "train.log_every=50"], "configs/lm_branch.yaml")
    return plan


# arm: (router, placement, dedup, pipeline chunks); E=8 on 2 x 2: tree-prefix is contiguous placement
LINK_ARMS = {
    "baseline": ("switch", "contiguous", "none", 1),
    "pipelined": ("switch", "contiguous", "none", 4),
    "node_dedup": ("switch", "contiguous", "node", 1),
    "branch_limit1": ("branch_linear_limit1", "contiguous", "none", 1),
    "all": ("branch_linear_limit1", "tree_prefix", "node", 4),
    "all_bal": ("branch_linear_limit1_bal", "tree_prefix", "node", 4),
    "deepseek_v3_node1": ("deepseek_v3_node1", "contiguous", "node", 1),
    "deepseek_v3_node1_pipelined": ("deepseek_v3_node1", "contiguous", "node", 4),
}
LINK_MODEL = ["model.d_model=256", "model.ffn_hidden_size=128", "model.heads=4"]
# regime: (run-id prefix, model and router overrides). "fine": small experts and a larger top-k,
# as modern MoE layers have (DeepSeek-V3: ffn 2048 at hidden 7168, top-8 of 256): ffn = d_model / 4
LINK_REGIMES = {
    "today": ("lmL", LINK_MODEL),  # the key is in the committed rows; tables name it REGIME_NAMES["today"]
    "fine": ("lmF", ["model.d_model=256", "model.ffn_hidden_size=64", "model.heads=4", "router.num_experts=16",
                     "router.top_k=4"]),
    "fine_top8": ("lmG", ["model.d_model=256", "model.ffn_hidden_size=64", "model.heads=4", "router.num_experts=32",
                          "router.top_k=8"]),
}


REGIME_NAMES = {"today": "coarse"}  # what tables and pages call a regime whose key says otherwise


def throughput_link(seeds=(0,), steps: int = 40) -> Plan:
    """The tiny LM at a size where the link matters (d_model 256: the baseline's measured
    all-to-all is most of its step on the 400 mbit emulated link): the baseline, each factor
    alone (pipelining, node dedup, BRANCH subtree_limit 1; tree-prefix placement coincides with
    contiguous at E=8 on 2 x 2), all of them together (the limit unbalanced and balanced), and the
    peer, DeepSeek-V3 node-limited with node dedup, pipelined and not; in the coarse regime (E=8
    top-2, ffn d_model / 2) and the fine-grained ones (E=16 top-4 and E=32 top-8, ffn d_model / 4)."""
    plan = Plan("throughput_link", "emulated", before="before_calibrate", after="after_exchange_time",
                post="post_step_prediction")
    for regime, (prefix, model) in LINK_REGIMES.items():
        for arm, (router, placement, dedup, chunks) in LINK_ARMS.items():
            for seed in seeds:
                plan.add(f"{prefix}-{arm}-s{seed}", {"arm": arm, "regime": regime, "router": router,
                                                     "placement": placement, "dedup": dedup, "chunks": chunks,
                                                     "seed": seed},
                         [f"seed={seed}", *ROUTER_ARMS[router], f"parallel.placement={placement}",
                          f"parallel.dedup={dedup}", f"parallel.pipeline_chunks={chunks}", *model,
                          f"train.max_steps={steps}", "train.batch_size=16", "data.per_domain=500",
                          "train.log_every=20"], "configs/lm_branch.yaml")
    return plan


# arm: (router, placement, dedup, ep_size, ep_layout). The baseline is EP 4 without dedup; "auto" is what
# parallel.ep_size: auto takes (with node dedup) on the launch's calibrated links
LAYOUT_ARMS = {
    "ep4": ("switch", "contiguous", "none", 4, "contiguous"),
    "ep4_branch_node": ("branch_linear_limit1_bal", "tree_prefix", "node", 4, "contiguous"),
    "ep2_contiguous": ("switch", "contiguous", "none", 2, "contiguous"),
    "ep2_strided_node": ("switch", "contiguous", "node", 2, "strided"),
    "ep1": ("switch", "contiguous", "none", 1, "contiguous"),
    "auto": ("switch", "contiguous", "node", "auto", "contiguous"),
}


def ep_layouts(seeds=(0,), steps: int = 40) -> Plan:
    """Expert-parallel layouts of 4.b's coarse LM on the emulated 2 x 2 (400 mbit): EP 4 over both nodes
    (without dedup, and BRANCH-limited with node dedup), EP 2 groups inside each node with their replicas
    across the link, EP 2 groups across the link with their replicas inside each node, EP 1 (every rank
    every expert), and the layout parallel.ep_size: auto takes on the launch's calibrated links."""
    plan = Plan("ep_layouts", "emulated", before="before_calibrate_topology", post="post_layout_step")
    for arm, (router, placement, dedup, ep, layout) in LAYOUT_ARMS.items():
        for seed in seeds:
            plan.add(f"lmL-{arm}-s{seed}", {"arm": arm, "router": router, "placement": placement, "dedup": dedup,
                                            "seed": seed},
                     [f"seed={seed}", *ROUTER_ARMS[router], f"parallel.placement={placement}",
                      f"parallel.dedup={dedup}", f"parallel.ep_size={ep}", f"parallel.ep_layout={layout}",
                      *LINK_MODEL, f"train.max_steps={steps}", "train.batch_size=16", "data.per_domain=500",
                      "train.log_every=20"], "configs/lm_branch.yaml")
    return plan


LM_ROUTER_ARMS = ("branch_linear", "branch_linear_limit1", "branch_linear_limit1_bal", "switch", "deepseek_v3",
                  "deepseek_v3_node1")


def lm_routers(seeds=range(3), steps: int = 200) -> Plan:
    """The routers comparison on the tiny MoE LM (configs/lm_branch.yaml: E=8 top-2 in both layers,
    no capacity limit), validation nats per byte; 4 ranks as 2 x 2, node dedup."""
    plan = Plan("lm_routers", "ranks", post="post_routing_bytes")
    for arm in LM_ROUTER_ARMS:
        for seed in seeds:
            plan.add(f"lm-{arm}-s{seed}", {"dataset": "lm_domains", "arm": arm, "seed": seed},
                     [f"seed={seed}", *ROUTER_ARMS[arm], f"parallel.placement={run_placement(arm)}",
                      "parallel.dedup=node", f"train.max_steps={steps}", "data.per_domain=500",
                      "train.log_every=50"], "configs/lm_branch.yaml")
    return plan


PLANS = {"routers": routers, "specdrop": specdrop, "gar": gar, "gar_ep": gar_ep, "throughput": throughput,
         "throughput_link": throughput_link, "lm_routers": lm_routers, "ep_layouts": ep_layouts}
