"""What Megatron does on a GPU that its CPU path skips, run here: its experts' and shared experts' weights
drawn from its named RNG streams (``use_cpu_initialization=False``), which raise unless seeded as its own
training seeds them; and the Transformer-Engine-absent patch, which a GPU without TE needs too."""
import os
import subprocess
import sys

from tests.support.dist_utils import run_cases

ROUTER = {"type": "switch", "num_experts": 4, "top_k": 2}
NOT_SEEDED = "rng state expert-parallel-rng is not added"  # Megatron's tracker, CUDA's or the CPU one


def _gpu_initialisation(rank, world):
    import pytest
    import torch

    from dist_moe.integrations.megatron import hosts, patches
    from dist_moe.moe.layer import MoELayerConfig

    patches.apply()
    from megatron.core.tensor_parallel import random

    from dist_moe.train.config import load_config
    from dist_moe.train.layer_config import layer_config
    from dist_moe.train.runtime import Runtime

    as_on_cpu = hosts.megatron_config
    hosts.megatron_config = lambda *a, **k: as_on_cpu(*a, **{**k, "use_cpu_initialization": False})  # a GPU's path
    random.get_cuda_rng_tracker().reset()  # nothing seeded the streams
    cfg = load_config(None, ["engine=megatron", "model.capacity_factor=null", f"parallel.ep_size={world}"])
    rt = Runtime(cfg.engine, cfg.parallel)
    try:
        # a layer built without the engine: nothing seeds Megatron's streams, and it raises as on a GPU
        with pytest.raises(Exception, match=NOT_SEEDED):
            hosts.MegatronHostedMoE(MoELayerConfig(8, 16, dict(ROUTER)), world)
        torch.manual_seed(cfg.seed)  # as the trainer does before building the model
        first = rt.build_moe(layer_config(cfg, 8, dict(ROUTER)))  # the engine seeds them first
        weights = [m.linear_fc1.weight.detach().clone() for m in first.moe.experts.local_experts]
        again = rt.build_moe(layer_config(cfg, 8, dict(ROUTER)))  # seeded once per run: the streams go on
        assert not torch.equal(weights[0], again.moe.experts.local_experts[0].linear_fc1.weight)
        # each expert-parallel rank draws its own experts (seed + 1024 + 100 * its EP rank)
        mine = torch.cat([w.reshape(-1) for w in weights])
        both = [torch.empty_like(mine) for _ in range(world)]
        torch.distributed.all_gather(both, mine)
        assert not torch.equal(both[0], both[1])
    finally:
        hosts.megatron_config = as_on_cpu
        rt.shutdown()
    assert not random.get_cuda_rng_tracker().get_states()  # the next run seeds its own


def test_the_megatron_engine_seeds_megatrons_rng_streams_before_its_gpu_initialisation():
    run_cases(2, [(_gpu_initialisation,)])


def test_a_gpu_run_without_transformer_engine_gets_the_te_absent_patch_and_no_cpu_patch():
    code = ("import torch; cuda = torch.cuda.current_device\n"
            "from dist_moe.integrations.megatron import patches; patches.apply(cpu=False)\n"
            "from megatron.core.transformer.moe import moe_utils\n"
            "assert not moe_utils.HAVE_TE and moe_utils.te_general_gemm is None\n"
            "assert torch.cuda.current_device is cuda and not patches._APPLIED  # stock code otherwise\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
