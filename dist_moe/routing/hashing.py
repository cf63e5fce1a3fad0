"""A 32-bit avalanche hash (MurmurHash3's finaliser) on int64 tensors.

Used by the hash router (Hash Layers: a fixed hash of a token id) and by
SpecDrop's Bernoulli masks, which must be identical on every rank that sees a
token, so they are derived from (seed, step, token id, expert) rather than from
a generator's state.
"""
from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def fmix32(h: Tensor) -> Tensor:
    # int64 products wrap modulo 2^64, which leaves the low 32 bits exact.
    h = h & _MASK32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def hash_combine(*parts: Tensor | int) -> Tensor:
    """Hash several int64 tensors (broadcast together) into one 32-bit value each. Python ints
    mix as Python ints (the same low 32 bits), so no tensor is made off the inputs' device."""
    h: Tensor | int | None = None
    for part in parts:
        v = fmix32(part.long() if isinstance(part, Tensor) else int(part))  # type: ignore[arg-type]  # int too
        h = v if h is None else fmix32(h * 31 + v)
    assert isinstance(h, Tensor), "at least one tensor part"
    return h


def hash_rows(x: Tensor) -> Tensor:
    """A 32-bit id per row of a feature matrix, from the bytes of its float32 values."""
    bits = x.detach().float().contiguous().view(torch.int32).long() & _MASK32
    h = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    for col in range(bits.shape[1]):  # loop over features, not tokens
        h = fmix32(h * 31 + bits[:, col])
    return h


def uniform01(h: Tensor) -> Tensor:
    """Map 32-bit hashes to floats in [0, 1), strictly below 1 in float32 (so u < 1.0 always)."""
    return (h >> 8).float() / float(2**24)  # 24 bits: exact in float32
