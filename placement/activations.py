"""The activations one MoE layer keeps for its backward on one rank, estimated from its shape.

With T tokens per rank routed to k experts each, a rank receives P = T * k (row, expert) pairs in a balanced
step, as C <= P copies (one per token and destination rank with rank dedup, C = P without). It keeps:

- the copies it received and their outputs, in the wire dtype (2 * C * H * wire bytes; none on one rank);
- its experts' rows, in the compute dtype: the gathered inputs and the outputs the gates scale (2 * P * H),
  and the intermediates the activation needs (SwiGLU 4 * P * F: both projections, the SiLU, the product;
  GELU 2 * P * F);
- per pair its gate and the indices that sort and sum it (``PAIR_BYTES``), per token the router's
  fp32 probabilities over the E experts.

Not counted: the layer's input (the previous layer keeps it), its weights and their compute-dtype copies
(one per forward, the weights' size, not the tokens'), and the LoRA kind's rank-wide intermediates.
``benchmarks/activation_memory.py`` measures the same on CPU, side by side with this estimate.
"""
from __future__ import annotations

from placement.forecast import ModelShape

# each pair's gate (fp32) and the int64 indices kept to sort its rows and sum them back
PAIR_BYTES = 4 * 8 + 4
INTERMEDIATES = {"swiglu": 4, "gelu": 2}  # [P, F] tensors an expert's activation keeps


def activation_bytes(shape: ModelShape, compute_bytes: int, wire_bytes: int | None = None, copies: int | None = None,
                     kind: str = "swiglu") -> int:
    """Bytes one MoE layer of ``shape`` keeps for backward on one rank (see above). ``wire_bytes`` None:
    nothing is exchanged (every expert on this rank); ``copies``: rows received (default the pairs, T * k)."""
    tokens = shape.tokens_per_rank
    pairs = tokens * shape.top_k
    copies = pairs if copies is None else copies
    rows = 0 if wire_bytes is None else 2 * copies * shape.hidden * wire_bytes
    experts_rows = pairs * (2 * shape.hidden + INTERMEDIATES[kind] * shape.ffn) * compute_bytes
    return rows + experts_rows + pairs * PAIR_BYTES + tokens * shape.experts * 4
