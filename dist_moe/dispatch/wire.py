"""The dtype an exchange's rows travel in.

``auto`` (the default) is the dtype the experts compute in, so under bf16 (autocast's, DeepSpeed's, a model
loaded in bf16) rows cross the link in bf16, as the engines' own dispatchers send them; ``fp32`` and ``bf16``
name it. ``fp8`` sends the forward dispatch as DeepSeek-V3 and DeepEP do: e4m3 values with one fp32 scale
per 128 values of a row (a width that is not a multiple of 128 ends in a shorter group), packed with their
scales into one row of bytes (H + 4 * ceil(H / 128)), which every backend carries; the combine and both
backwards travel in bf16. Node dedup's second hop forwards the packed rows as they came. The experts
dequantize on arrival, and the gradient of a received row flows back as through a plain cast (the
quantization's own gradient is taken as the identity). Gates (fp32) and routes travel as they are."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dist_moe.config.choices import WIRE_DTYPES
from dist_moe.dispatch.apply_experts import compute_dtype
from placement.traffic import FP8_GROUP, wire_row_bytes

_NAMED = {"fp32": torch.float32, "bf16": torch.bfloat16}
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
# what every rank of an exchange must send alike in its header (agree.py names a disagreement by these)
WIRE_CODES = {"fp32": 1, "bf16": 2, "fp16": 4, "fp8": 8}
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_wire_dtype(name) -> str:
    if name not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}, got {name!r}")
    if name == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"wire_dtype fp8 needs torch's float8 dtypes, which torch {torch.__version__} lacks")
    return name


def fp8_row_bytes(width: int) -> int:
    """Bytes of one packed fp8 row: its values, then one fp32 scale per ``FP8_GROUP`` of them (the count
    ``placement`` prices)."""
    return wire_row_bytes(width, "fp8")


def quantize(h: Tensor) -> Tensor:
    """[R, H] -> [R, fp8_row_bytes(H)] uint8: each group of 128 values of a row scaled by its largest
    magnitude to e4m3's range (scale = amax / 448), the values then the fp32 scales."""
    rows, width = h.shape
    groups = math.ceil(width / FP8_GROUP)
    padded = F.pad(h.float(), (0, groups * FP8_GROUP - width)).view(rows, groups, FP8_GROUP)
    scale = padded.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) / E4M3_MAX
    values = (padded / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(rows, groups * FP8_GROUP)[:, :width]
    return torch.cat([values.contiguous().view(torch.uint8), scale.view(torch.uint8)], 1)


def dequantize(packed: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    """``quantize``'s rows back as [R, width] values in ``dtype``."""
    rows, groups = packed.shape[0], math.ceil(width / FP8_GROUP)
    values = packed[:, :width].contiguous().view(torch.float8_e4m3fn).float()
    scale = packed[:, width:].contiguous().view(torch.float32)
    padded = F.pad(values, (0, groups * FP8_GROUP - width)).view(rows, groups, FP8_GROUP) * scale.unsqueeze(-1)
    return padded.view(rows, groups * FP8_GROUP)[:, :width].to(dtype)


@dataclass(frozen=True)
class Wire:
    """One forward's wire: ``rows``, the dtype of the combine and of every backward (and of the forward
    dispatch unless ``fp8``, whose dispatch is packed e4m3 rows)."""

    rows: torch.dtype
    fp8: bool = False

    @property
    def code(self) -> int:
        """A number every rank of an exchange must send alike (its header carries it)."""
        return WIRE_CODES.get(self.name, 16)

    @property
    def name(self) -> str:
        return "fp8" if self.fp8 else _NAMES.get(self.rows, str(self.rows))

    def dispatch_row_bytes(self, width: int) -> int:
        return fp8_row_bytes(width) if self.fp8 else width * self.rows.itemsize

    def pack(self, h: Tensor) -> Tensor:
        """The forward dispatch's payload of rows ``h``."""
        return quantize(h.detach()) if self.fp8 else h.to(self.rows)

    def unpack(self, x: Tensor, width: int) -> Tensor:
        """Received dispatch rows as values in ``rows``' dtype (fp8: dequantized, outside autograd)."""
        return dequantize(x, width, self.rows) if self.fp8 else x


def wire_dtype(name: str, h: Tensor) -> Wire:
    """What rows like ``h`` travel in under ``name`` (``auto``: the experts' compute dtype for them)."""
    if name == "auto":
        return Wire(compute_dtype(h))
    if name == "fp8":
        return Wire(torch.bfloat16, fp8=True)
    return Wire(_NAMED[name])
