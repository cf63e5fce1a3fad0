"""The tiny multi-domain MoE LM: the corpus, training, and expert parallelism equal to one process."""
import pytest
import torch

from dist_moe import MoELayer
from dist_moe.models.tiny_lm import TinyMoELM, lm_loss
from tests.support.dist_utils import run_workers

corpus = pytest.importorskip("dist_moe.data.corpus")
from dist_moe.data.sources import FORTUNES, WORDNET  # noqa: E402

HAVE_CORPUS = FORTUNES.joinpath("fortunes").exists() and WORDNET.joinpath("data.noun").exists()
needs_corpus = pytest.mark.skipif(not HAVE_CORPUS, reason="Debian fortunes-min and wordnet-base not installed "
                                                          "(make installs them when run as root)")
D = 32


@needs_corpus
def test_corpus_has_four_balanced_domains(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path))
    c = corpus.load_corpus(seq_len=32, per_domain=300)
    assert c.tokens.shape == (1200, 33) and c.tokens.dtype == torch.uint8
    assert c.domain.bincount().tolist() == [300, 300, 300, 300]
    code = bytes(c.tokens[c.domain == 3][0].tolist())
    assert code.decode("utf-8", errors="replace")  # Python source bytes
    again = corpus.load_corpus(seq_len=32, per_domain=300)  # from the cache
    assert torch.equal(again.tokens, c.tokens)


@needs_corpus
def test_lm_learns_with_domain_routing(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path))
    c = corpus.load_corpus(seq_len=32, per_domain=300)
    torch.manual_seed(0)
    router = {"type": "specdrop", "num_experts": 4, "num_categories": 4, "p_assigned": 0.7}
    model = TinyMoELM(lambda i: MoELayer(D, 64, dict(router)), d_model=D)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        rows = torch.arange(step * 16, step * 16 + 16) % len(c.tokens)
        x, y = c.tokens[rows, :-1].long(), c.tokens[rows, 1:].long()
        logits, aux = model(x, c.domain[rows])
        loss = lm_loss(logits, y)
        opt.zero_grad()
        (loss + aux).backward()
        opt.step()
        losses.append(float(loss))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0  # from ~5.5 nats (uniform bytes) downwards


def _ep_worker(rank, world, router):
    import torch.distributed as dist

    from placement import Placement

    torch.manual_seed(0)
    ref = TinyMoELM(lambda i: MoELayer(D, 48, dict(router)), d_model=D)
    placement = Placement.round_robin(8, world)
    ep = TinyMoELM(lambda i: MoELayer(D, 48, dict(router), placement=placement, group=dist.group.WORLD,
                                      dedup="node" if world == 4 else "rank"), d_model=D)
    state = {k: v for k, v in ref.state_dict().items() if ".experts." not in k}
    ep.load_state_dict(state, strict=False)
    for b_ref, b_ep in zip(ref.blocks, ep.blocks):
        for name, p in b_ep.moe.experts.named_parameters():
            p.data.copy_(getattr(b_ref.moe.experts, name).data[b_ep.moe.local_expert_ids])
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (4 * world, 12), generator=g)
    cats = torch.randint(0, 4, (4 * world,), generator=g)
    mine = slice(4 * rank, 4 * rank + 4)
    y_ref, _ = ref(x, cats)
    y, _ = ep(x[mine], cats[mine])
    assert torch.allclose(y, y_ref[mine], atol=1e-4), (router["type"], float((y - y_ref[mine]).abs().max()))


@pytest.mark.parametrize("world,router", [
    (2, {"type": "specdrop", "num_experts": 8, "num_categories": 4, "p_assigned": 0.6}),
    (2, {"type": "hash", "num_experts": 8, "top_k": 2}),
    (4, {"type": "switch", "num_experts": 8, "top_k": 2, "jitter_eps": 0.0}),
])
def test_expert_parallel_lm_equals_one_process(world, router):
    run_workers(_ep_worker, world, args=(router,), timeout=120)


@needs_corpus
def test_lm_trains_from_its_config_with_metrics_and_schedules_of_every_layer(tmp_path, monkeypatch):
    import json

    from dist_moe.moe.view import moe_layers
    from dist_moe.train.config import load_config
    from dist_moe.train.trainer import train

    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path / "data"))
    out = tmp_path / "run"
    cfg = load_config("configs/lm_branch.yaml", [f"output.dir={out}", "train.max_steps=60", "data.per_domain=300",
                                                 "data.categories=domains", "router.type=specdrop",
                                                 "router.num_categories=4", "router.p_assigned=0.7"])
    summary = train(cfg, quiet=True, after=lambda model, data, rt: {
        "progress": [float(layer.router.progress) for layer in moe_layers(model)]})
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in lines if "loss" in r]
    assert losses[-1] < losses[0] - 1.0
    assert summary["router"] == "specdrop" and 0 <= summary["val_align"] <= 1
    assert summary["progress"] == [59 / 60, 59 / 60]  # the schedule moved in both layers, not only the first
    row = lines[-2]  # the last training row: both layers' metrics, and their mean
    assert row["load_cv"] == pytest.approx((row["layer0_load_cv"] + row["layer1_load_cv"]) / 2)
    assert summary["val_load_cv"] == pytest.approx((summary["val_layer0_load_cv"] + summary["val_layer1_load_cv"]) / 2)
    # (SpecDrop routes both layers alike; the mean of layers that differ:)
    from dist_moe.train.metrics.routing import layers_metrics

    assert layers_metrics([{"cv": 1.0, "share": [0.25, 0.75]}, {"cv": 3.0, "share": [0.5, 0.5]}]) == \
        {"cv": 2.0, "share": [0.375, 0.625], "layer0_cv": 1.0, "layer0_share": [0.25, 0.75], "layer1_cv": 3.0,
         "layer1_share": [0.5, 0.5]}


def test_lm_config_errors_name_the_value(tmp_path, capsys):
    from dist_moe.cli import main

    assert main(["train", "--quiet", f"output.dir={tmp_path}", "model.kind=lm"]) == 2
    assert "data.name=corpus" in capsys.readouterr().err
    assert main(["train", "--quiet", f"output.dir={tmp_path}", "model.kind=rnn"]) == 2
    assert "'model.kind'" in capsys.readouterr().err


@needs_corpus
def test_demo_script_trains_on_two_emulated_nodes_and_reports(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.support.dist_utils import free_port

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "demo"
    env = {**os.environ, "DIST_MOE_DATA": str(tmp_path / "data"), "DEMO_PORT": str(free_port()),
           "VIRTUAL_ENV": sys.prefix}  # the demo runs this interpreter's environment
    for name in ("WORLD_SIZE", "CONDA_PREFIX"):
        env.pop(name, None)
    proc = subprocess.run([str(root / "launch/demo.sh"), str(out), "train.max_steps=20", "data.per_domain=200"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # node 0's two ranks say what they train with (node 1's go to its log); the CPU on any host
    said = [line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert said == [f"torch {torch.__version__}, device cpu, backend gloo"] * 2, proc.stdout[-2000:]
    assert f"report at {out}/report.md" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["topology"] == "node=2,gpu=2" and report["run_dispatch"]["dedup"] == "node"
    assert len(report["layers"]) == 2  # every MoE layer, each with its own measured == analytic bytes
    for layer in report["layers"]:
        run = layer["run_dispatch"]
        assert run["measured_bytes_by_level"] == run["analytic_bytes_by_level"] and run["dedup"] == "node"
    assert json.loads((out / "summary.json").read_text())["world_size"] == 4
