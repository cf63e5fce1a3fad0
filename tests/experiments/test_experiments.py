"""The experiments behind docs/RESULTS.md: their statistics, grids, measurements and resumable runner."""
import json
import math

import pytest
import torch

from dist_moe.data.text_tasks import TextSplit
from dist_moe.models.text import TextMoE
from dist_moe.moe.layer import MoELayer
from dist_moe.train.config import load_config
from experiments import measures, plans, stats, tables


class _Local:  # the Runtime surface the measurements use, for one process
    world, rank = 1, 0

    def sum(self, t):
        return t


def test_paired_t_matches_student_t_tables():
    assert stats.t_quantile_975(4) == pytest.approx(2.7764, abs=1e-3)  # the papers' t_4 critical value
    assert stats.t_quantile_975(2) == pytest.approx(4.3027, abs=1e-3)
    assert stats.t_two_sided_p(3.25, 4) == pytest.approx(0.0314, abs=1e-3)
    p = stats.paired([1.0, 2.0, 3.0], [0.5, 1.0, 2.5])  # differences 0.5, 1.0, 0.5
    sd = math.sqrt(((0.5 - 2 / 3) ** 2 * 2 + (1 / 3) ** 2) / 2)
    assert p["mean"] == pytest.approx(2 / 3) and p["t"] == pytest.approx((2 / 3) / (sd / math.sqrt(3)))
    assert p["lo"] == pytest.approx(2 / 3 - 4.3027 * sd / math.sqrt(3), abs=1e-3)


def test_scipy_statistics_give_the_numbers_the_hand_written_integration_gave():
    """Values the project's earlier numerical integration and bisection printed (2026-12-01)."""
    before_p = {(3.25, 4): 0.03137573429297569, (0.5, 2): 0.6666666666872428, (2.1, 9): 0.06511828256419316,
                (-1.7, 4): 0.16435494141311024, (10.0, 1): 0.06345103488711046}
    before_q = {1: 12.706204741436444, 2: 4.302652732176437, 4: 2.7764451071018836, 9: 2.262157164506559,
                29: 2.0452296437440856}
    for (t, df), p in before_p.items():
        assert stats.t_two_sided_p(t, df) == pytest.approx(p, abs=1e-6)
    for df, q in before_q.items():
        assert stats.t_quantile_975(df) == pytest.approx(q, abs=1e-6)
    before = {"n": 3, "mean": 0.6666666666666666, "t": 4.0, "p": 0.05719095847613476, "lo": -0.05044212202940612,
              "hi": 1.3837754553627395}
    after = stats.paired([1.0, 2.0, 3.0], [0.5, 1.0, 2.5])
    assert after.keys() == before.keys() and all(after[k] == pytest.approx(v, abs=1e-6) for k, v in before.items())
    assert stats.paired([1.0, 2.0], [0.0, 1.0])["t"] == math.inf  # no spread: infinite t, p = 0


@pytest.mark.parametrize("name", sorted(plans.PLANS))
def test_every_planned_run_is_a_valid_config_with_a_unique_id(name):
    plan = plans.PLANS[name]()
    ids = [r["id"] for r in plan.runs]
    assert len(ids) == len(set(ids)) and ids
    for run in plan.runs:
        cfg = load_config(run["config"], run["overrides"])  # raises on an unknown key or a bad value
        assert cfg.output.dir.endswith(run["id"])


def test_routers_grid_pairs_every_arm_over_the_same_seeds():
    plan = plans.routers()
    cells = {(r["labels"]["dataset"], r["labels"]["arm"]) for r in plan.runs}
    assert len(cells) == len(plans.DATASETS) * len(plans.ROUTER_ARMS)
    assert len(plan.runs) == len(cells) * 5


def _text_data(num_tasks=3, per_task=12, seq=5, hidden=384):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tasks * per_task, seq, hidden, generator=g)
    x[:, -2:] = 0  # padding positions are exact zeros
    t = torch.arange(num_tasks).repeat_interleave(per_task)
    y = torch.randint(0, 2, (len(t),), generator=g)
    split = TextSplit(x, y, t, x, y, t, (2,) * num_tasks)
    return split


def test_gar_diagnostics_on_routing_that_separates_tasks_exactly():
    """Hard SpecDrop with one expert per task: every expert's gradient mass and selections come
    from one task, so purity and NMI are 1; loads follow the task sizes (equal here: LVar 0)."""
    torch.manual_seed(0)
    data = _text_data()
    moe = MoELayer(384, 16, {"type": "specdrop", "num_experts": 3, "num_categories": 3, "variant": "hard",
                             "p_assigned": 1.0}, expert_type="lora")
    with torch.no_grad():
        moe.experts.lora_B.normal_()  # LoRA B starts at zero: give lora_A a gradient too
    out = measures.after_gar_diagnostics(TextMoE(moe, data.task_classes), data, _Local(), group_size=4)
    assert out["gradient_purity"] == pytest.approx(1.0)
    assert out["nmi"] == pytest.approx(1.0)
    assert out["lvar"] == pytest.approx(0.0, abs=1e-12) and out["utilization"] == 1.0


def test_gar_diagnostics_on_task_blind_routing():
    """Uniform routing (every expert, equal gates) carries no task information: NMI 0, equal loads."""
    data = _text_data()
    moe = MoELayer(384, 16, {"type": "uniform", "num_experts": 4}, expert_type="lora")
    with torch.no_grad():
        moe.experts.lora_B.normal_()
    out = measures.after_gar_diagnostics(TextMoE(moe, data.task_classes), data, _Local(), group_size=4)
    assert out["nmi"] == pytest.approx(0.0, abs=1e-9)
    assert out["lvar"] == pytest.approx(0.0, abs=1e-12) and out["utilization"] == 1.0
    assert 1 / 3 <= out["gradient_purity"] < 1.0  # three tasks share every expert


def test_text_model_keeps_its_moe_in_the_graph_on_an_empty_batch():
    """A rank's empty part of a GAR group (or of a diagnostic batch) still backpropagates through
    the MoE, whose backward exchanges every rank joins: its zero loss must reach the MoE output."""
    moe = MoELayer(384, 16, {"type": "switch", "num_experts": 4, "top_k": 2}, expert_type="lora")
    model = TextMoE(moe, (2, 3))
    logits, _ = model(torch.zeros(0, 5, 384), torch.zeros(0, dtype=torch.long))
    assert logits.shape == (0, 3)
    (logits.sum() * 0.0).backward()
    assert all(p.grad is not None for p in moe.experts.parameters() if p.requires_grad)


def _diagnostics_worker(rank, world):
    """after_gar_diagnostics with the experts over ``world`` ranks equals it in one process."""
    import torch.distributed as dist

    from dist_moe.distributed.reductions import all_reduce_sum
    from placement import Placement

    class _Ranks:
        def __init__(self):
            self.rank, self.world = rank, world

        def sum(self, t):
            return all_reduce_sum(t, dist.group.WORLD)

    data = _text_data(num_tasks=3, per_task=10)
    router = {"type": "switch", "num_experts": 4, "top_k": 2}
    torch.manual_seed(0)
    ref = MoELayer(384, 16, router, expert_type="lora")
    with torch.no_grad():
        ref.experts.lora_B.normal_()
    ep = MoELayer(384, 16, router, expert_type="lora", group=dist.group.WORLD,
                  placement=Placement.round_robin(4, world))
    ep.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.startswith("experts.")}, strict=False)
    for name, p in ep.experts.named_parameters():
        p.data.copy_(getattr(ref.experts, name).data[ep.local_expert_ids] if p.shape != getattr(ref.experts, name).shape
                     else getattr(ref.experts, name).data)
    heads = TextMoE(ref, data.task_classes)
    one = measures.after_gar_diagnostics(heads, data, _Local(), group_size=4)
    many = TextMoE(ep, data.task_classes)
    many.heads.load_state_dict(heads.heads.state_dict())
    out = measures.after_gar_diagnostics(many, data, _Ranks(), group_size=4)
    for key, value in one.items():  # every rank reports the one-process numbers
        assert out[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (rank, key, out[key], value)


def test_gar_diagnostics_under_expert_parallelism_equal_one_process():
    from tests.support.dist_utils import run_workers

    run_workers(_diagnostics_worker, 2, timeout=120)


def test_masking_measure_counts_predictions_outside_the_category():
    class Fixed(torch.nn.Module):  # predicts class 0 for every row
        class_category = torch.tensor([0, 0, 1, 1])

        def forward(self, x, c):
            return torch.tensor([[5.0, 0.0, 1.0, 0.0]]).expand(len(x), 4), torch.zeros(())

    class Data:
        x_val = torch.zeros(4, 2)
        y_val = torch.tensor([0, 1, 2, 3])

        def val_categories(self, rows=slice(None)):
            return torch.tensor([0, 0, 1, 1])[rows]

    out = measures.after_masking(Fixed(), Data(), _Local())
    # unmasked: class 0 everywhere (1 of 4 right, 2 rows leave their category); masked: 0, 0, 2, 2 (2 right)
    assert out["left_category"] == 0.5 and out["val_acc_masked"] == 0.5 and out["masking_gain"] == 0.25


def test_plan_rows_append_and_finished_runs_are_skipped(tmp_path, monkeypatch):
    from experiments import run as runner
    from experiments.worker import run_plan

    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path / "data"))
    results = tmp_path / "r.jsonl"
    runs = [{"id": f"magic-{arm}", "labels": {"arm": arm}, "config": None,
             "overrides": [f"router.type={arm}", "data.max_rows=600", "train.max_steps=3", "train.batch_size=64",
                           f"output.dir={tmp_path / arm}", "router.num_experts=16", "router.top_k=4"]}
            for arm in ("branch", "switch")]
    run_plan({"results": str(results), "post": "post_routing_bytes", "runs": runs[:1]})
    assert runner.done_ids(results) == {"magic-branch"}
    run_plan({"results": str(results), "post": "post_routing_bytes",
              "runs": [r for r in runs if r["id"] not in runner.done_ids(results)]})
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["magic-branch", "magic-switch"]
    for r in rows:  # dedup never sends more across nodes; node dedup sends at most one copy per node
        for place in ("tree_prefix", "optimized"):
            assert r[f"copies_{place}_node"] <= r[f"copies_{place}_rank"] <= r[f"copies_{place}_none"] <= 4
            assert r[f"copies_{place}_node"] <= 1.0
        assert r["lower_bound_copies"] == 0.5 and 0 < r["train_seconds"] <= r["seconds"] + 0.01  # 2-decimal rounding


def test_results_block_is_replaced_not_duplicated(tmp_path):
    doc = tmp_path / "RESULTS.md"
    doc.write_text("# Results\n\nprose before\n")
    tables.replace_block(doc, "routers", "table one")
    tables.replace_block(doc, "routers", "table two")
    tables.replace_block(doc, "gar", "gar table")
    text = doc.read_text()
    assert text.count("<!-- results:routers -->") == 1 and "table two" in text and "table one" not in text
    assert text.startswith("# Results\n\nprose before") and "gar table" in text


def test_expert_parallel_gar_table_pairs_each_run_with_its_one_process_seed(tmp_path):
    """gar_ep's table: EP minus one process for the same arm and seed, and GAR minus task-only
    within the same rank count; one-process seeds the EP runs lack are left out of the pairs."""
    from experiments.table_gar import make_ep

    def row(arm, seed, purity, **more):
        return {"arm": arm, "seed": seed, "date": "2026-12-03", "train_seconds": 1.0, "val_macro_acc": 0.7,
                "lvar": 0.001, "utilization": 1.0, "gradient_purity": purity, "nmi": 0.01, **more}

    one = [row(arm, s, 0.40 + s / 100 + (0.02 if arm == "gar_1" else 0.0)) for arm in ("task_only", "gar_1")
           for s in range(3)]
    ep = [row(arm, s, 0.40 + s / 100 + (0.05 if arm == "gar_1" else 0.0) + 0.01, ranks=2)
          for arm in ("task_only", "gar_1") for s in range(2)]
    text = make_ep(ep, tmp_path, one)
    lines = text.splitlines()
    against = lines[lines.index(next(x for x in lines if x.startswith("Expert parallel minus"))):]
    assert any(x.startswith("| 2 | task_only | 2 | ") and "+0.0100 [" in x for x in against)
    assert any(x.startswith("| 2 | gar_1 | 2 | ") and "+0.0400 [" in x for x in against)
    effect = lines[lines.index(next(x for x in lines if x.startswith("GAR's effect"))):]
    assert any(x.startswith("| 2 | gar_1 | 2 | ") and "+0.0500 [" in x for x in effect)


def _needs_wordnet():
    from dist_moe.data.sources import FORTUNES, WORDNET

    if not (WORDNET / "data.noun").exists() or not (FORTUNES / "fortunes").exists():
        pytest.skip("Debian wordnet-base / fortunes-min not installed (make installs them as root)")


def test_wordnet_lexicographer_files_sit_inside_their_part_of_speech():
    """The 45 lexname labels: each data.<pos> file holds exactly the files named for its part of speech."""
    _needs_wordnet()
    from dist_moe.data.sources import wordnet_synsets
    from dist_moe.data.tabular import class_categories
    from dist_moe.data.wordnet_glosses import LEXNAMES, PARTS

    assert len(LEXNAMES) == 45
    cats, names = class_categories("wordnet_pos", "wordnet_glosses", list(LEXNAMES))
    assert names == list(PARTS)
    for part in PARTS:
        files = {f for _, f in wordnet_synsets(part)}
        want = "adj" if part == "adj" else part
        assert {LEXNAMES[f].split(".")[0] for f in files} == {want}
        assert {int(cats[f]) for f in files} == {PARTS.index(part)}
    counts = torch.bincount(cats, minlength=4).tolist()
    assert counts == [26, 15, 3, 1]  # noun, verb, adj (all, pert, ppl), adv


def test_five_task_text_mixture_labels():
    _needs_wordnet()
    from dist_moe.data.text_tasks import TASKS, task_examples

    assert TASKS == ("pos", "lexname", "verblex", "source", "domain")
    classes = {}
    for task in ("verblex", "domain"):
        texts, labels, n = task_examples(task)
        assert len(texts) == len(labels) and set(labels) == set(range(n))
        classes[task] = n
    assert classes == {"verblex": 15, "domain": 4}


def test_step_model_prices_the_bytes_the_training_steps_sent(tmp_path, monkeypatch):
    """post_step_prediction prices train_traffic.json's bytes per step (summed over steps), not a
    replay of validation routing: rank 0 -> rank 2 (across nodes) 4 MB over 4 steps is 1 MB a step."""
    from placement import CostModel

    monkeypatch.setenv("DIST_MOE_TOPOLOGY", "node=2,gpu=2")
    monkeypatch.setattr(measures, "_FITTED", {})  # the cost model's default links
    matrix = [[0] * 4 for _ in range(4)]
    matrix[0][2], matrix[1][0] = 4_000_000, 400_000  # across nodes; inside node 0
    (tmp_path / "train_traffic.json").write_text(json.dumps({"steps": 4, "layers": [matrix, matrix]}))
    summary = {"output_dir": str(tmp_path), "train_seconds": 8.0, "steps": 4, "world_size": 4, "exchange_wait_s": 2.0}
    cfg = load_config(None, ["parallel.dedup=node", "train.batch_size=2", "data.seq_len=8"])
    out = measures.post_step_prediction(summary, cfg)
    links = CostModel.default(["node", "gpu"]).levels
    node_s = links["node"].alpha_s + 1_000_000 / links["node"].bandwidth_Bps
    gpu_s = links["gpu"].alpha_s + 100_000 / links["gpu"].bandwidth_Bps
    assert out["priced_from"] == "training steps"
    assert out["predicted_hop_s"] == [pytest.approx([node_s, gpu_s])] * 2
    assert out["predicted_comm_s"] == pytest.approx(2 * 4 * (node_s + gpu_s))
    assert out["step_s"] == 2.0 and out["exchange_wait_step_s"] == 0.5
