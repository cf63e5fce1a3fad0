"""Every change dist-moe makes to megatron-core (written against 0.16.1), in one place.

All of them make Megatron's CPU path run (tests and benchmarks on gloo); none is
applied when CUDA is available, so GPU runs use Megatron's stock code. ``apply()``
must run before megatron.core is imported and is idempotent.
"""
from __future__ import annotations

import torch

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    # 0.16.1: model-parallel set-up and the stock router call torch.cuda.current_device()
    # (Router.gating moves its weights there); on CPU that raises. Point it at the CPU.
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    # 0.16.1: without Transformer Engine, router_gating_linear references te_general_gemm
    # unguarded (NameError in the stock TopKRouter); None selects its torch matmul path.
    moe_utils.te_general_gemm = None
    # 0.16.1: the alltoall dispatcher creates a torch.cuda.Stream for device-to-host copies
    # of its split sizes and synchronises on it; on CPU the sizes only need to become lists.
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _splits_to_lists
    _APPLIED = True


def _splits_to_lists(self, point: str, tokens_per_expert=None):
    for name in ("input_splits", "output_splits", "output_splits_tp"):
        value = getattr(self, name, None)
        if isinstance(value, torch.Tensor):
            setattr(self, name, value.tolist())
    return tokens_per_expert
