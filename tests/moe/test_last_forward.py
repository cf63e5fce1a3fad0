"""What a forward leaves behind: its routing always; the router's [T, H] input only for a reader that asks
(GAR's recomputation), so no layer holds its activations across steps for nothing."""
import torch

from dist_moe import MoELayer


def test_the_router_input_is_kept_only_when_asked_for():
    layer = MoELayer(8, 16, {"type": "switch", "num_experts": 4, "top_k": 2})
    x = torch.randn(2, 5, 8)
    layer(x)
    last = layer.last_forward
    assert last.routing is not None and last.router_input is None and last.layout[0] == (2, 5)
    last.keep_inputs = True
    layer(x)
    h, extras, layout = layer.moe_view().last_forward.inputs()
    assert torch.equal(h, x.reshape(-1, 8)) and not h.requires_grad and layout[0] == (2, 5)
