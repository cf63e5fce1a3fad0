"""dist-moe's dispatcher inside transformers' expert parallelism (``ep_implementation="dist_moe"``),
against transformers' own ``all_to_all``.

Tiny random Mixtral, Qwen3-MoE and DeepSeek-V3 models (DeepSeek-V3 group-limited: ``n_group`` = the
nodes, ``topk_group`` = 1), saved once and loaded by every rank with
``DistributedConfig(ep_size=W, fsdp_size=W, ...)``: per step the losses, and every gradient, equal
those of transformers' ``all_to_all`` implementation from the same checkpoint (1e-5), for dedup none,
rank and node and 1 and 3 chunks on 4 ranks as 2 nodes x 2 (on 2 ranks of one node: rank dedup, 3 chunks),
every rank checking its own;
the bytes each rank measured equal ``dispatch_traffic`` of the routings its layers ran; node dedup's
node-crossing bytes are below none's; ``save_pretrained`` then ``from_pretrained`` round-trips exactly.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.dist_utils import free_port

pytest.importorskip("transformers.distributed.expert_parallel", reason="transformers >= 5.25 is not installed")
pytest.importorskip("accelerate", reason="transformers' distributed loading needs accelerate")


SCRIPT = Path(__file__).parents[1] / "support" / "scripts" / "transformers_ep.py"


@pytest.mark.parametrize("world,topology", [(2, "node=1,gpu=2"), (4, "node=2,gpu=2")])
def test_transformers_models_train_through_dist_moe_like_their_all_to_all(world, topology, tmp_path):
    """Launched as a user launches it (torchrun; every rank must exit 0, teardown included)."""
    # the cases name their topology; the EP-2-of-4 case reads the launch's from here (4 nodes of 1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIST_MOE_TOPOLOGY": f"node={world},gpu=1"}
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), topology, "save"], check=True, env=env, timeout=120)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(SCRIPT), str(tmp_path), topology],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    for rank in range(world):
        assert f"OK rank {rank}" in proc.stdout, proc.stdout[-6000:]
