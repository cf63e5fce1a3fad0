"""dist-moe inside Hugging Face transformers (written against transformers 5.25): the public names.

* ``ep.py``: ``use(...)`` registers dist-moe's dispatcher as transformers' expert-parallel
  implementation ``"dist_moe"``; ``traffic(model)`` / ``reset_traffic(model)``.
* ``hosted.py``: ``host_experts(model, ...)``, a model's experts sharded by any placement and
  dispatched by dist-moe (``dist-moe train``'s ``model.kind: hf``).
"""
from dist_moe.integrations.transformers.ep import (
    NAME,
    StackedExperts,
    contiguous_placement,
    implementation_class,
    reset_traffic,
    traffic,
    use,
)

__all__ = ["NAME", "StackedExperts", "contiguous_placement", "implementation_class", "reset_traffic", "traffic",
           "use"]
