"""The benchmarks' shared helpers keep working as the trainer's config grows (they broke once)."""
import torch

from benchmarks.common import ROUTERS, optimized_placement, train_router
from placement import Topology


def test_trained_router_and_its_optimized_placement(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path))
    topo = Topology(("node", "gpu"), (2, 2))
    model, data = train_router(ROUTERS["branch"], torch.zeros(16, dtype=torch.long), epochs=1)
    with torch.no_grad():
        logits, _ = model(data.x_val)
    assert float((logits.argmax(-1) == data.y_val).double().mean()) > 0.7  # it learned magic
    placement = optimized_placement(model, data, topo)
    assert sorted(placement.expert_to_rank) == [r for r in range(4) for _ in range(4)]
