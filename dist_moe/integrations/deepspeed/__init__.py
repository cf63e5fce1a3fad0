"""dist-moe inside DeepSpeed's MoE (written against 0.19.8): the public names.

* ``layer.py``: ``DistMoEGate`` (any strategy as DeepSpeed's gate), ``deepspeed_moe_layer`` (a
  ``deepspeed.moe.layer.MoE`` with it), ``init_distributed`` / ``shutdown_distributed``, and the
  trainer's host (``DeepSpeedHostedMoE``).
* ``dispatch.py``: ``use_dist_moe_dispatcher``, dist-moe's dispatcher inside DeepSpeed's MoE layer.
* ``patches.py``: the CPU patches this release needs (applied on first use).
"""
from dist_moe.integrations.deepspeed.dispatch import use_dist_moe_dispatcher
from dist_moe.integrations.deepspeed.layer import (
    DeepSpeedHostedMoE,
    DistMoEGate,
    deepspeed_capacity,
    deepspeed_moe_layer,
    expert_slots,
    init_distributed,
    load_dist_moe_experts,
    shutdown_distributed,
)

__all__ = ["DeepSpeedHostedMoE", "DistMoEGate", "deepspeed_capacity", "deepspeed_moe_layer",
           "expert_slots", "init_distributed", "load_dist_moe_experts", "shutdown_distributed",
           "use_dist_moe_dispatcher"]
