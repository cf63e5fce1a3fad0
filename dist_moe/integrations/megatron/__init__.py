"""dist-moe inside megatron-core (written against 0.16.1): the public names.

* ``dist_moe_mlp_spec`` / ``megatron_dist_moe_layer`` (``layer.py``): Megatron's MoE layer with
  dist-moe's router and dispatcher (the one-line change of a GPT layer spec).
* ``DistMoERouter`` (``router.py``): any strategy as Megatron's router, Megatron's own token
  dispatcher moving the tokens (the router swap).
* ``hosts.py``: a ``TransformerConfig`` for one MoE layer (``megatron_config``), Megatron's layer with
  the router swap (``megatron_moe_layer``), its RNG streams seeded (``seed_model_parallel_rng``), weight
  and gradient converters, and the trainer's host
  (``MegatronHostedMoE``).
* ``patches.py``: the patches this release needs (applied on first use): its CPU path, and Transformer
  Engine's absence.
"""
from dist_moe.integrations.megatron.hosts import (
    MegatronHostedMoE,
    expert_grads_as_dist_moe,
    load_dist_moe_experts,
    megatron_config,
    megatron_moe_layer,
    seed_model_parallel_rng,
    sent_bytes,
)
from dist_moe.integrations.megatron.layer import dist_moe_mlp_spec, megatron_dist_moe_layer
from dist_moe.integrations.megatron.patches import DISPATCHERS
from dist_moe.integrations.megatron.router import DistMoERouter, aux_coefficient

__all__ = ["DISPATCHERS", "DistMoERouter", "MegatronHostedMoE", "aux_coefficient",
           "dist_moe_mlp_spec", "expert_grads_as_dist_moe", "load_dist_moe_experts", "megatron_config",
           "megatron_dist_moe_layer", "megatron_moe_layer", "seed_model_parallel_rng", "sent_bytes"]
