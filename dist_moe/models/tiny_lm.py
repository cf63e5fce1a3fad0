"""A tiny byte-level transformer LM with an MoE FFN in every layer.

Pre-norm blocks: x + attn(ln(x)), then x + moe(ln(x)); causal multi-head
attention through ``scaled_dot_product_attention``; the output head shares the
byte embedding. Each sequence's domain is its SpecDrop category (one per
sequence, broadcast to its tokens by the MoE layer); hash routing keys on the
byte at each position. ``moe_factory(layer_index)`` returns any layer with
MoELayer's interface (``dist_moe.train.runtime.Runtime.build_moe``), so the same
model runs on dist-moe's dispatcher or an engine-hosted layer.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB = 256  # bytes


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, moe: nn.Module):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} must be divisible by heads {heads}")
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.moe = moe

    def forward(self, x: Tensor, categories: Tensor | None, token_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(attn)
        y, aux = self.moe(self.ln2(x), categories=categories, token_ids=token_ids)
        return x + y, aux


class TinyMoELM(nn.Module):
    def __init__(self, moe_factory: Callable[[int], nn.Module], d_model: int = 64, layers: int = 2, heads: int = 4,
                 max_len: int = 256):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.zeros(max_len, d_model))
        self.blocks = nn.ModuleList(Block(d_model, heads, moe_factory(i)) for i in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.max_len = max_len

    def forward(self, tokens: Tensor, categories: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """tokens [B, S] bytes (int64), categories [B] -> (logits [B, S, 256], summed aux loss)."""
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_len {self.max_len}")
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        aux = torch.zeros((), device=tokens.device)
        for block in self.blocks:
            ids = tokens if "token_ids" in block.moe.router.inputs else None
            x, a = block(x, categories, ids)
            aux = aux + a
        return self.ln(x) @ self.embed.weight.t(), aux


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
