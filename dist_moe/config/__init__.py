"""The vocabulary of the training config, below everything that reads it: the names and bounds its
keys take (``choices.py``: the schema checks values against them and the modules that implement each
choice read them from here) and what a typed field accepts (``types.py``). The schema itself is
``dist_moe/train/run_config.py``; YAML files and overrides are read by ``dist_moe/train/config.py``."""
