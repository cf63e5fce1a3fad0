"""Every change dist-moe makes to megatron-core (written against 0.16.1), in one place, and the
release's token dispatchers that host dist-moe's router (``DISPATCHERS``).

All but one make Megatron's CPU path run (tests and benchmarks on gloo) and are not applied on a
GPU run, which uses Megatron's stock code; the one that depends on whether Transformer Engine is
installed, not on the device, is applied on both. ``apply()`` must run before megatron.core is
imported and is idempotent.
"""
from __future__ import annotations

import contextlib
import sys
import warnings

import torch
from torch.distributed import ProcessGroup

from dist_moe.config.choices import MEGATRON_DISPATCHERS
from dist_moe.optional_engines import engine_import

# Megatron's token dispatchers (config.moe_token_dispatcher_type) that host dist-moe's router
DISPATCHERS = MEGATRON_DISPATCHERS
_APPLIED = False
# What megatron.core's modules say on import where Apex and Transformer Engine are missing. Both are CUDA-only: on
# the CPU there is nothing to install, so the notes are dropped there; a GPU run keeps them (installing is the fix).
APEX_NOTES = r"(Transformer Engine and )?Apex (is|are) not installed"
# The modules that say it and are not imported on the way to the patches: imported with them under the same filter,
# so that dist-moe's layer specs and a user's get_gpt_layer_local_spec find them loaded (0.02 s)
_NOTING_MODULES = ("megatron.core.models.backends", "megatron.core.models.gpt.gpt_layer_specs")
# and what one of those says of another of Megatron's own modules, which it still imports
OWN_DEPRECATION = r"The 'megatron\.core\.transformer\.custom_layers\.transformer_engine'\s+module is deprecated"


def apply(cpu: bool | None = None) -> None:
    """``cpu``: the run's device choice (None: the CPU when no GPU is visible); on a GPU run
    Megatron's stock code runs, patched only where Transformer Engine is missing."""
    cpu = cpu if cpu is not None else not torch.cuda.is_available()
    with _without_import_notes(cpu):
        _without_transformer_engine(cpu)
        _patch_cpu_path(cpu)


@contextlib.contextmanager
def _without_import_notes(cpu: bool):
    if not cpu or _APPLIED:  # a GPU run keeps them; once applied, the modules are loaded: nothing more to say
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=APEX_NOTES, category=UserWarning)
        warnings.filterwarnings("ignore", message=OWN_DEPRECATION, category=DeprecationWarning)
        yield
        for module in _NOTING_MODULES:
            engine_import(module)


def _patch_cpu_path(cpu: bool) -> None:
    global _APPLIED
    if _APPLIED or not cpu:
        return
    # 0.16.1: model-parallel set-up and the stock router call torch.cuda.current_device()
    # (Router.gating moves its weights there); on CPU that raises. Point it at the CPU.
    torch.cuda.current_device = lambda: "cpu"
    MoEAlltoAllTokenDispatcher = engine_import("megatron.core.transformer.moe.token_dispatcher",
                                               "MoEAlltoAllTokenDispatcher")

    # 0.16.1: the alltoall dispatcher creates a torch.cuda.Stream for device-to-host copies
    # of its split sizes and synchronises on it; on CPU the sizes only need to become lists.
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _splits_to_lists
    # 0.16.1: the RNG tracker that attention dropout and expert initialisation fork keeps CUDA
    # generator states (model_parallel_cuda_manual_seed, DotProductAttention); keep CPU ones.
    from megatron.core.tensor_parallel import random

    random.CudaRNGStatesTracker = _cpu_rng_tracker(random.CudaRNGStatesTracker)
    # 0.16.1: its linear layers' autograd functions carry the forward's autocast into their backward
    # for CUDA only (custom_fwd / custom_bwd with device_type="cuda"). Under CPU autocast
    # (train.precision bf16) their backward would multiply a bf16 gradient by the fp32 weight and
    # raise; decorated for the CPU, the backward runs its GEMMs in bf16 as the forward did.
    from megatron.core.tensor_parallel import layers

    for fn in (layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight):
        fn.forward = staticmethod(torch.amp.custom_fwd(fn.forward.__wrapped__, device_type="cpu"))
        fn.backward = staticmethod(torch.amp.custom_bwd(fn.backward.__wrapped__, device_type="cpu"))
    if not torch.cuda.is_available():
        # 0.16.1: dist_checkpointing's torch_dist saver calls torch.cuda.synchronize() unguarded
        # (filesystem_async.preload_tensors); a torch without CUDA has nothing to wait for.
        torch.cuda.synchronize = lambda device=None: None
    _APPLIED = True


def _without_transformer_engine(cpu: bool) -> None:
    """0.16.1: without Transformer Engine (a failed import leaves ``moe_utils.HAVE_TE`` False),
    router_gating_linear references te_general_gemm unguarded (NameError in the stock TopKRouter, on a
    GPU as on the CPU); None selects its torch matmul path, as it does on the CPU, where TE's kernels
    cannot run."""
    moe_utils = engine_import("megatron.core.transformer.moe", "moe_utils")
    if cpu or not moe_utils.HAVE_TE:
        moe_utils.te_general_gemm = None


def _cpu_rng_tracker(base):
    class CpuRNGStatesTracker(base):
        """Megatron's named RNG streams (model-parallel, expert-parallel, ...) on the CPU generator."""

        def add(self, name, seed):
            if seed in self.seeds_ or name in self.states_:
                raise Exception(f"rng state {name} or seed {seed} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def _splits_to_lists(self, point: str, tokens_per_expert=None):
    for name in ("input_splits", "output_splits", "output_splits_tp"):
        value = getattr(self, name, None)
        if isinstance(value, torch.Tensor):
            setattr(self, name, value.tolist())
    return tokens_per_expert


def release_parallel_state() -> list[str]:
    """``parallel_state.destroy_model_parallel()``, then drop the groups it forgets (0.16.1:
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its ``_GLOO`` twin stay set; the aux-loss
    tracker keeps the reduce groups of every layer that logged a loss). A group kept
    past ``destroy_process_group`` lives until interpreter exit, where its threads can abort the
    process (dist_moe/distributed/groups.py). Runs on CPU and GPU alike; returns the names it cleared."""
    parallel_state = engine_import("megatron.core", "parallel_state")
    parallel_state.destroy_model_parallel()
    cleared = []
    random = sys.modules.get("megatron.core.tensor_parallel.random")
    if random is not None and random.get_cuda_rng_tracker().get_states():  # the next run seeds its own
        random.get_cuda_rng_tracker().reset()
        cleared.append("random._CUDA_RNG_STATE_TRACKER")
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None and moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER:  # its entries hold reduce groups
        moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER.clear()
        cleared.append("moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER")
    for name, value in vars(parallel_state).items():
        items = value if isinstance(value, (list, tuple)) else [value]
        if not name.startswith("_") or not any(isinstance(v, ProcessGroup) for v in items):
            continue
        setattr(parallel_state, name, None)
        cleared.append(name)
    return cleared
