"""The MoE layer and what every MoE host shares: ``MoELayer`` and its typed config ``MoELayerConfig``
(``layer.py``), the staged forward of every host whose tokens travel through dist-moe's dispatcher
(``host.py``), the experts (``experts.py``) and what the trainer reads from any host (``view.py``)."""
