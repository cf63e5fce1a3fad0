"""The MoE layer and what every MoE host shares: ``MoELayer`` and its typed config ``MoELayerConfig``
(``layer.py``); the forward every host runs, stage by stage, and what it keeps (``forward.py``); routes a
model's own router chose (``chosen.py``); a router told the cluster's boundaries (``cluster.py``); the
experts (``experts.py``) and what the trainer reads from any host (``view.py``)."""
