"""What `dist-moe calibrate` prints of its fit: the collective latency with the middle half of its repeats, and per
level whether alpha was clipped at 0 or the level not measured at all."""
from dist_moe.cli.calibrate import summary
from placement import CostModel, LevelCost, Topology
from placement.calibrate import Calibration, Spread


def test_the_summary_says_how_noisy_the_latency_was_and_which_alpha_was_clipped():
    topo = Topology(("rack", "node", "gpu"), (2, 2, 1))
    levels = {"rack": LevelCost(0.0, 40e6, shared=True), "node": LevelCost(2.2e-3, 2e9), "gpu": LevelCost(5e-6, 150e9)}
    fitted = Calibration(CostModel(levels).with_exchange(2.63e-3, 0.86), Spread(2.63e-3, 2.12e-3, 6.39e-3, 40))
    head, rack, node, gpu = summary(topo, fitted)
    assert head.startswith("rack=2,node=2,gpu=1: collective latency 2,630 us (the middle half of its 40 repeats "
                           "2,120-6,390 us)"), head
    assert rack.endswith("(alpha clipped at 0: no cost per peer showed beyond the collective latency)"), rack
    assert "clipped" not in node and "default" not in node, node
    assert gpu.endswith("(the default: no exchange crosses this level here)"), gpu
