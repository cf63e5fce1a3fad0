"""``python -m dist_moe.cli``: the ``dist-moe`` command (what torchrun and the deepspeed launcher run)."""
import sys

from dist_moe.cli import main

sys.exit(main())
