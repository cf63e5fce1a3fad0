"""docs/gpu-clusters.md's multi-node commands start 2 nodes x 8 GPUs: each one's config, with its overrides, is
accepted on those 16 ranks, checked here without launching them (the layout ``parallel.ep_size=auto`` takes, the
expert-parallel groups, the placement of each group's experts, the engine's own rules)."""
import pytest

from dist_moe.train.config import load_config
from dist_moe.train.layout_choice import choose_layout
from placement import Placement, Topology
from placement.ep_groups import ExpertLayout
from tests.support.doc_commands import ROOT, commands

PAGE = "docs/gpu-clusters.md"
CLUSTER = Topology.parse("node=2,gpu=8")  # what the page's multi-node commands launch
GPU_MEMORY = 80 * 2**30  # bytes free per rank, an H100's: what parallel.ep_size=auto prices against


def accepted_on(args: list[str], topology: Topology) -> str:
    """The layout the run of ``dist-moe train ARGS`` takes on ``topology``, or the ValueError it stops with."""
    at = args.index("--config")
    cfg = load_config(str(ROOT / args[at + 1]), args[:at] + args[at + 2:])
    if cfg.parallel.ep_size == "auto":
        cfg, _ = choose_layout(cfg, topology, GPU_MEMORY, "cuda")
    layout = ExpertLayout(topology, cfg.parallel.ep_size or topology.world_size, cfg.parallel.ep_layout)
    experts = cfg.router.num_experts
    for rank in range(topology.world_size):  # each rank's group places the experts over its own ranks
        Placement.named(cfg.parallel.placement, experts, layout.group_topology(rank))
    if cfg.engine != "torch" and layout.replicas > 1 and layout.layout != "contiguous":
        raise ValueError(f"engine {cfg.engine} builds contiguous expert-parallel groups only")
    if cfg.engine == "deepspeed" and experts % layout.ep_size:
        raise ValueError(f"DeepSpeed needs num_experts ({experts}) divisible by ep_size ({layout.ep_size})")
    return layout.describe()


def _training_templates():
    return [c for c in commands([PAGE]) if c.left_out == "a template for other hosts" and c.train_args]


def test_the_page_shows_multi_node_commands_for_16_ranks():
    found = _training_templates()
    assert {c.text.split()[0] for c in found} >= {"torchrun", "launch/torchrun.sh", "launch/deepspeed.sh"}, found
    for c in found:  # a command that says its node and process counts says 2 x 8
        words = c.text.split()
        counts = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--nnodes", "--nproc-per-node", "--nproc")}
        assert counts.get("--nnodes", "2") == "2" and counts.get("--nproc-per-node", counts.get("--nproc", "8")) == "8"


@pytest.mark.parametrize("command", _training_templates(), ids=lambda c: f"line {c.line}")
def test_each_multi_node_command_s_config_fits_16_ranks(command):
    """The page's config has 8 experts: without an expert-parallel layout (parallel.ep_size) that fits, the run
    stops with "8 experts over 16 ranks"."""
    said = accepted_on(command.train_args, CLUSTER)
    assert said.startswith("EP "), said


def test_the_check_refuses_what_a_16_rank_run_refuses():
    with pytest.raises(ValueError, match="8 experts over 16 ranks"):
        accepted_on(["--config", "configs/lm_branch.yaml"], CLUSTER)
    with pytest.raises(ValueError, match="engine deepspeed builds contiguous"):
        accepted_on(["--config", "configs/lm_branch.yaml", "parallel.ep_size=8", "parallel.ep_layout=strided",
                     "engine=deepspeed"], CLUSTER)
