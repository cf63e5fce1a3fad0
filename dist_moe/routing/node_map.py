"""Scalar score maps evaluated for many outputs in one batched computation.

BRANCH-MoE's internal nodes and the flat routers' expert logits use the same
two forms (BRANCH paper, eq. 3-4 and appendix B.3):

* linear:  f_n(x) = w_n^T x                       (no bias)
* mlp:     f_n(x) = v_n^T ReLU(U_n x + c_n)       (private 2-layer MLP per output, no output bias)

Every output owns its parameters; the forward is one matmul (linear) or two
einsums (mlp), never a Python loop over outputs. The mlp's hidden units are
[T, outputs, mlp_hidden] (at T 16k, 255 outputs, mlp_hidden 64: 1 GiB in fp32),
so they are made ``MLP_CHUNK_BYTES`` at a time and never kept: the backward
makes each chunk's again from the input (activation recomputation), in fp32
as the forward, the router's scores staying exact.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from dist_moe.routing.base import positive_int
from placement.simulate import check_memory

MLP_CHUNK_BYTES = 64 * 2**20  # the mlp's hidden units made at once, forward and backward


class NodeMap(nn.Module):
    def __init__(self, hidden_size: int, num_outputs: int, kind: str = "linear", mlp_hidden: int | None = None):
        super().__init__()

        hidden_size = positive_int("hidden_size", hidden_size)
        if kind not in ("linear", "mlp"):
            raise ValueError(f"node_map must be 'linear' or 'mlp', got {kind!r}")
        if kind == "mlp" and (not isinstance(mlp_hidden, int) or mlp_hidden < 1):
            raise ValueError(f"mlp_hidden must be a positive int for node_map='mlp', got {mlp_hidden!r}")
        if kind == "linear" and mlp_hidden is not None:
            raise ValueError("mlp_hidden is only valid with node_map='mlp'")
        if kind == "mlp":  # refused before allocating: weights, gradients and Adam's two moments in fp32
            assert mlp_hidden is not None  # checked above

            check_memory(16 * num_outputs * mlp_hidden * (hidden_size + 2),
                         f"mlp_hidden={mlp_hidden} ({num_outputs} node MLPs on hidden size {hidden_size}, to train)",
                         "lower mlp_hidden")
        self.kind = kind
        self.hidden_size = hidden_size
        self.num_outputs = num_outputs
        bound = 1.0 / math.sqrt(hidden_size)
        if kind == "linear":
            self.weight = nn.Parameter(torch.empty(num_outputs, hidden_size).uniform_(-bound, bound))
        else:
            assert mlp_hidden is not None  # checked above
            self.U = nn.Parameter(torch.empty(num_outputs, mlp_hidden, hidden_size).uniform_(-bound, bound))
            self.c = nn.Parameter(torch.empty(num_outputs, mlp_hidden).uniform_(-bound, bound))
            vb = 1.0 / math.sqrt(mlp_hidden)
            self.v = nn.Parameter(torch.empty(num_outputs, mlp_hidden).uniform_(-vb, vb))

    def forward(self, x: Tensor) -> Tensor:
        """x [T, hidden] (fp32) -> scores [T, num_outputs] (fp32)."""
        if self.kind == "linear":
            return x @ self.weight.float().t()
        return _ChunkedMLP.apply(x, self.U.float(), self.c.float(), self.v.float())


def _token_chunks(x: Tensor, u: Tensor) -> int:
    """Tokens per chunk: ``MLP_CHUNK_BYTES`` of hidden units (at least one token)."""
    return max(1, MLP_CHUNK_BYTES // (4 * u.shape[0] * u.shape[1]))


def _hidden(x: Tensor, u: Tensor, c: Tensor) -> Tensor:
    return torch.relu(torch.einsum("th,nkh->tnk", x, u) + c)


class _ChunkedMLP(torch.autograd.Function):
    """scores[t, n] = v_n . ReLU(U_n x_t + c_n), chunk by chunk over tokens, keeping only the inputs."""

    @staticmethod
    def forward(ctx, x: Tensor, u: Tensor, c: Tensor, v: Tensor):
        ctx.save_for_backward(x, u, c, v)
        step = _token_chunks(x, u)
        return torch.cat([torch.einsum("tnk,nk->tn", _hidden(xs, u, c), v) for xs in x.split(step)]) \
            if x.shape[0] else x.new_zeros((0, u.shape[0]))

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, u, c, v = ctx.saved_tensors
        gu, gc, gv = torch.zeros_like(u), torch.zeros_like(c), torch.zeros_like(v)
        gx = []
        step = _token_chunks(x, u)
        for xs, gs in zip(x.split(step), grad.split(step)):
            hid = _hidden(xs, u, c)  # recomputed: the forward kept none
            gv += torch.einsum("tnk,tn->nk", hid, gs)
            g_hid = torch.einsum("tn,nk->tnk", gs, v) * (hid > 0)
            gc += g_hid.sum(0)
            gu += torch.einsum("tnk,th->nkh", g_hid, xs)
            gx.append(torch.einsum("tnk,nkh->th", g_hid, u))
        return (torch.cat(gx) if gx else torch.zeros_like(x)), gu, gc, gv
