"""Expert MLPs with stacked weights (dim 0 = expert), run over tokens grouped by expert.

Kinds: ``swiglu`` down(SiLU(gate(x)) * up(x)), ``gelu`` fc2(GELU(fc1(x))), and
``lora`` x W0 + s (x A_e) B_e with a frozen shared base W0 and per-expert
LoRA factors. Stacked weights make the GAR parameter template direct: slot
``name`` of every expert is ``param[e]`` (LoRA A and B are separate slots).

Every linear block goes through ``_linear`` so that GAR's factorized Gram mode
can record block inputs and output gradients without a second code path.
"""
from __future__ import annotations

import math

import psutil
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dist_moe.config.choices import EXPERT_KINDS
from dist_moe.dispatch.apply_experts import compute_dtype

KINDS = EXPERT_KINDS
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what F.grouped_mm takes on the CPU
# torch's fast grouped GEMM on a GPU: bf16, on compute capability 9.x and 10.x (Hopper, Blackwell). Elsewhere on
# CUDA F.grouped_mm falls back to a per-group mm after reading the offsets to the host, a stall per projection
# per chunk; the experts then run their own loop, sized by the counts the forward reads once.
FAST_GROUPED_DTYPE, FAST_GROUPED_MAJORS = torch.bfloat16, (9, 10)


def grouped_kernel(device: torch.device, dtype: torch.dtype, capability: tuple[int, int] | None = None) -> bool:
    """Whether ``F.grouped_mm`` runs its own kernel for ``dtype`` on ``device`` (``capability``: the GPU's,
    None: asked of torch)."""
    if device.type != "cuda":
        return dtype in GROUPED_DTYPES
    major = (capability or torch.cuda.get_device_capability(device))[0]
    return dtype == FAST_GROUPED_DTYPE and major in FAST_GROUPED_MAJORS


def experts_path(device: torch.device, dtype: torch.dtype, capability: tuple[int, int] | None = None) -> str:
    """How the experts compute on ``device`` in ``dtype``, for the rank line."""
    if grouped_kernel(device, dtype, capability):
        return f"grouped GEMM ({str(dtype).removeprefix('torch.')})"
    return (f"per-expert loop ({str(dtype).removeprefix('torch.')}: torch's fast grouped GEMM is bf16 on "
            "compute capability 9.x/10.x)")


def aligned(tensors) -> bool:
    """Every tensor's data 16-byte aligned (the CUDA kernel reads 16-byte vectors)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def grouped_ok(x: Tensor, weights: list[Tensor], dtype: torch.dtype | None = None) -> bool:
    """Whether ``F.grouped_mm`` takes rows like ``x`` against these [E, in, out] weights here with its own
    kernel (``grouped_kernel``), every stride but the unit one a multiple of 16 bytes (the CUDA kernels' rule;
    a width of 10 fp32 numbers fails it) and, on a GPU, the data 16-byte aligned. ``dtype``: what rows and
    weights are cast to first (``compute_dtype``, autocast's); None: they must all be ``x``'s already."""
    if dtype is None:
        if any(w.dtype != x.dtype for w in weights):
            return False
        dtype = x.dtype
    if x.dim() != 2 or not grouped_kernel(x.device, dtype):
        return False
    if x.is_cuda and not aligned([x, *weights]):  # the CPU's grouped_mm takes any alignment
        return False
    size = dtype.itemsize
    strides = [x.stride(0)] + [s for w in weights for s in w.stride() if s != 1]
    return all(s * size % 16 == 0 for s in strides)


def offsets(counts: Tensor) -> Tensor:
    """grouped_mm's group ends (int32, on the counts' device: no host read)."""
    return torch.cumsum(counts, 0, dtype=torch.int32)


def _init(shape, fan_in) -> nn.Parameter:
    bound = 1.0 / math.sqrt(fan_in)
    return nn.Parameter(torch.empty(*shape).uniform_(-bound, bound))


def expert_parameters(e: int, h: int, f: int, kind: str, lora_rank: int = 8) -> int:
    """How many numbers ``e`` experts of ``kind`` hold (LoRA's frozen shared base included)."""
    per_expert = {"swiglu": 3 * h * f, "gelu": 2 * h * f, "lora": 2 * h * lora_rank}[kind]
    return e * per_expert + (h * h if kind == "lora" else 0)


def _check_fits(e: int, h: int, f: int, kind: str, lora_rank: int) -> None:
    """Refuse, before allocating, expert weights (and their Adam state) larger than the memory available."""
    needed = 4 * 4 * expert_parameters(e, h, f, kind, lora_rank)  # fp32 weights, grads, Adam's two
    free = psutil.virtual_memory().available
    if needed > free:
        raise ValueError(f"{e} {kind} experts of hidden {h} x ffn {f} need about {needed / 2**30:.1f} GiB to train "
                         f"(weights, gradients, Adam), more than the {free / 2**30:.1f} GiB available")


class FactorCapture:
    """Block inputs x and output gradients delta, per template slot, for the Gram form.

    A capture that needs to know whose rows it saw (GAR's example and token units)
    gets ``source_tags(shape, padding, device) -> [T]`` from its owner: the MoE layer tags each of
    its tokens with it, the tags travel with the token copies, and every recorded
    chunk keeps its rows' tags in ``tags``.
    """

    def __init__(self, source_tags=None):
        self.inputs: dict[str, list[Tensor]] = {}
        self.grads: dict[str, list[Tensor]] = {}
        self.tags: dict[str, list[Tensor]] = {}
        self.source_tags = source_tags
        self.current_tags: Tensor | None = None  # tags of the chunk an expert is running on

    def record(self, slot: str, x: Tensor, out: Tensor) -> None:
        if not out.requires_grad:
            return
        self.inputs.setdefault(slot, []).append(x.detach())
        if self.current_tags is not None:
            self.tags.setdefault(slot, []).append(self.current_tags)
        grads = self.grads.setdefault(slot, [])
        index = len(grads)
        grads.append(None)

        def hook(g, index=index):
            grads[index] = g.detach()

        out.register_hook(hook)


class Experts(nn.Module):
    takes_weights = True  # forward(..., weights={slot: tensor}) runs on those copies (dispatch/pipeline.py)

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        kind: str = "swiglu",
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
    ):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"expert kind must be one of {KINDS}, got {kind!r}")
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("ffn_hidden_size", ffn_hidden_size), ("lora_rank", lora_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "num_experts" else 1):
                raise ValueError(f"experts: {name} must be a positive int, got {value!r}")
        self.num_experts, self.kind = num_experts, kind
        e, h, f = num_experts, hidden_size, ffn_hidden_size
        _check_fits(e, h, f, kind, lora_rank)
        if kind == "swiglu":
            self.w_gate = _init((e, h, f), h)
            self.w_up = _init((e, h, f), h)
            self.w_down = _init((e, f, h), f)
        elif kind == "gelu":
            self.w_fc1 = _init((e, h, f), h)
            self.w_fc2 = _init((e, f, h), f)
        else:
            self.base = nn.Parameter(_init((h, h), h).detach(), requires_grad=False)
            self.lora_A = _init((e, h, lora_rank), h)
            self.lora_B = nn.Parameter(torch.zeros(e, lora_rank, h))
            self.lora_scale = lora_alpha / lora_rank
        self.capture: FactorCapture | None = None

    def template(self) -> dict[str, nn.Parameter]:
        """Trainable stacked parameters; slot name -> [E, ...]."""
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def _linear(self, slot: str, x: Tensor, w: Tensor) -> Tensor:
        out = x @ w.to(x.dtype)
        if self.capture is not None and torch.is_grad_enabled():
            self.capture.record(slot, x, out)
        return out

    def expert(self, e: int, x: Tensor, weights: dict[str, Tensor] | None = None) -> Tensor:
        """Expert ``e`` on rows x; ``weights`` maps slot -> that expert's [in, out] weight."""
        w = weights if weights is not None else {n: p[e] for n, p in self.template().items()}
        if self.kind == "swiglu":
            h = F.silu(self._linear("w_gate", x, w["w_gate"])) * self._linear("w_up", x, w["w_up"])
            return self._linear("w_down", h, w["w_down"])
        if self.kind == "gelu":
            return self._linear("w_fc2", F.gelu(self._linear("w_fc1", x, w["w_fc1"])), w["w_fc2"])
        z = self._linear("lora_A", x, w["lora_A"])
        return x @ self.base.to(x.dtype) + self.lora_scale * self._linear("lora_B", z, w["lora_B"])

    def forward(self, x_sorted: Tensor, counts: list[int] | Tensor, tags: Tensor | None = None,
                weights: dict[str, Tensor] | None = None) -> Tensor:
        """x_sorted: tokens grouped by expert (expert 0's first); counts[e] rows each (a list, or a
        tensor on x's device: then the grouped path reads nothing back to the host); ``tags`` [rows],
        for a tagging capture, say whose row each is.

        Every projection runs as one grouped GEMM over all experts (``F.grouped_mm``, offsets made on
        the device), as Megatron's GroupedMLP does. The per-expert loop runs only where a grouped GEMM
        cannot: a width whose rows are not a multiple of 16 bytes (the kernels' stride rule, e.g.
        hidden 10 in fp32), a dtype it lacks, or GAR's factor capture, which records each expert's
        block inputs and output gradients apart. Both give the same numbers (tests/moe/test_grouped_experts.py).
        ``weights`` (slot -> stacked [E, ...] tensor) stand in for the parameters: a pipelined dispatch
        casts them once per forward and runs every chunk on the same copies."""
        weights = {**self.template(), **(weights or {})}
        x_sorted = x_sorted.to(compute_dtype(x_sorted))
        if self.grouped(x_sorted):
            return self._grouped_forward(x_sorted, counts, weights)
        return self._looped_forward(x_sorted, counts.tolist() if torch.is_tensor(counts) else counts, tags, weights)

    def grouped(self, x: Tensor) -> bool:
        """Whether ``forward`` runs grouped GEMMs on rows like ``x`` (see there), in the dtype it computes
        in (autocast's under bf16, not the dtype the rows arrive in)."""
        return self.capture is None and grouped_ok(x, list(self.template().values()), compute_dtype(x))

    def _grouped_forward(self, x: Tensor, counts: list[int] | Tensor, w: dict[str, Tensor]) -> Tensor:
        offs = offsets(torch.as_tensor(counts, device=x.device))

        def mm(a: Tensor, w: Tensor) -> Tensor:
            return F.grouped_mm(a, w.to(a.dtype), offs=offs)

        if self.kind == "swiglu":
            return mm(F.silu(mm(x, w["w_gate"])) * mm(x, w["w_up"]), w["w_down"])
        if self.kind == "gelu":
            return mm(F.gelu(mm(x, w["w_fc1"])), w["w_fc2"])
        return x @ self.base.to(x.dtype) + self.lora_scale * mm(mm(x, w["lora_A"]), w["lora_B"])

    def _looped_forward(self, x_sorted: Tensor, counts: list[int], tags: Tensor | None,
                        weights: dict[str, Tensor] | None = None) -> Tensor:
        # unbind once: its backward stacks the experts' gradients into one tensor, where
        # indexing p[e] per expert would zero-fill a full [E, ...] gradient for each expert
        views = {n: p.unbind(0) for n, p in (weights or self.template()).items()}
        tagging = self.capture is not None and tags is not None
        chunk_tags = tags.split(counts) if tagging else [None] * len(counts)
        outs = []
        for e, (chunk, chunk_tag) in enumerate(zip(x_sorted.split(counts), chunk_tags)):
            if chunk.shape[0]:
                if tagging:
                    self.capture.current_tags = chunk_tag
                outs.append(self.expert(e, chunk, {n: v[e] for n, v in views.items()}))
        if not outs:  # still an autograd function of the input and weights, like any other call
            if tagging:
                self.capture.current_tags = tags[:0]
            return self.expert(0, x_sorted[:0], {n: v[0] for n, v in views.items()})
        return torch.cat(outs)


class SingleExpert(nn.Module):
    """One expert as a module of its own: the unit DeepSpeed's and Megatron's expert
    containers replicate, with the same math and slot names as one slice of ``Experts``."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, kind: str = "swiglu", **expert_kwargs):
        super().__init__()
        self.inner = Experts(1, hidden_size, ffn_hidden_size, kind, **expert_kwargs)

    def forward(self, x: Tensor) -> Tensor:
        return self.inner.expert(0, x)


class SharedExpert(SingleExpert):
    """Always-on dense SwiGLU expert added after the routed merge (SpecDrop eq. 4)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__(hidden_size, ffn_hidden_size, "swiglu")
