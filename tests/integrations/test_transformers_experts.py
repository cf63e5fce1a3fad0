"""The transformers integration in one process: a model's stacked experts behind dist-moe's experts
contract compute what the model's own experts forward computes (grouped GEMMs where the layout allows,
its own forward otherwise), and what ``use`` / the placement refuse, in one line."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

pytest.importorskip("transformers.distributed.expert_parallel", reason="transformers >= 5.25 is not installed")

from dist_moe.integrations.stacked import grouped_mm  # noqa: E402
from dist_moe.integrations.transformers import StackedExperts, contiguous_placement, use  # noqa: E402
from placement import Placement, Topology  # noqa: E402


def _experts(kind: str, hidden: int = 32):
    from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    made = {
        "mixtral": lambda: MixtralExperts(MixtralConfig(hidden_size=hidden, intermediate_size=16, num_local_experts=4)),
        "qwen3_moe": lambda: Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=16,
                                                            num_experts=4)),
        "deepseek_v3": lambda: DeepseekV3Experts(DeepseekV3Config(hidden_size=hidden, moe_intermediate_size=16,
                                                                  n_routed_experts=4)),
        # biases, the gate's halves interleaved, weights transposed, a clamped gate of its own
        "gpt_oss": lambda: GptOssExperts(GptOssConfig(hidden_size=hidden, intermediate_size=16, num_local_experts=4)),
    }[kind]()
    with torch.no_grad():
        for p in made.parameters():
            p.normal_(0, 0.2)
    return made


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("hidden", [32, 30])  # 30 fp32 numbers: a row stride grouped_mm refuses -> own forward
def test_stacked_experts_compute_what_the_models_own_forward_computes(kind, hidden):
    experts = _experts(kind, hidden)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), hidden, requires_grad=True)
    ids = torch.repeat_interleave(torch.arange(4), counts).unsqueeze(1)
    want = experts(x, ids, torch.ones(x.shape[0], 1))
    adapter = StackedExperts(experts, experts.forward)
    with mock.patch("dist_moe.integrations.transformers.ep.grouped_mm", wraps=grouped_mm) as kernels:
        got = adapter(x, counts)
    assert kernels.call_count == (2 if hidden == 32 else 0)  # grouped GEMMs, or the experts' own forward
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    g_want = torch.autograd.grad(want.square().sum(), [x, *experts.parameters()])
    g_got = torch.autograd.grad(got.square().sum(), [x, *experts.parameters()])
    for a, b in zip(g_got, g_want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert set(adapter.template()) == {n for n, _ in experts.named_parameters()}


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_stacked_experts_under_bf16_autocast_compute_in_bf16(kind):
    """fp32 weights, bf16 autocast (train.precision bf16): the GEMMs run in bf16, biases included."""
    experts = _experts(kind)
    counts = torch.tensor([3, 1, 4, 2])
    x = torch.randn(int(counts.sum()), 32, requires_grad=True)
    ids = torch.repeat_interleave(torch.arange(4), counts).unsqueeze(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = StackedExperts(experts, experts.forward)(x, counts)
        want = experts(x, ids, torch.ones(x.shape[0], 1))
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.float(), atol=5e-2, rtol=5e-2)
    got.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in experts.parameters())


def test_placements_other_than_transformers_layout_are_refused_in_one_line(tmp_path):
    topology = Topology.parse("node=2,gpu=2")
    layout = Placement.contiguous(8, 4)
    for choice in (None, "contiguous", "tree_prefix", layout):
        assert contiguous_placement(choice, 8, topology).expert_to_rank == layout.expert_to_rank
    swapped = Placement([1, 1, 0, 0, 2, 2, 3, 3], 4)
    with pytest.raises(ValueError, match="puts expert 0 on rank 1, but transformers loads it on rank 0"):
        contiguous_placement(swapped, 8, topology)
    path = tmp_path / "place.yaml"
    swapped.to_yaml(path)
    with pytest.raises(ValueError, match=f"placement file {path} puts expert 0 on rank 1"):
        contiguous_placement(str(path), 8, topology)
    with pytest.raises(ValueError, match="places 8 experts on 4 ranks; the model has 16 on 4"):
        contiguous_placement(layout, 16, topology)


@pytest.mark.parametrize("kwargs,message", [
    ({"dedup": "nodes"}, "dedup"),
    ({"pipeline_chunks": 0}, "pipeline_chunks"),
    ({"topology": "node=2"}, "topology must be a placement.Topology"),
    ({"placement": 3}, "placement must be None"),
    ({"timeout": 30}, "timeout must be a datetime.timedelta"),
])
def test_use_refuses_bad_settings_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        use(**kwargs)
