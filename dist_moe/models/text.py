"""A multi-task text classifier: frozen MiniLM token states -> LoRA-expert MoE -> one head per task.

Inputs are the token states ``dist_moe.data.text_tasks`` cached from the frozen
backbone ([B, L, 384], padding positions exactly zero); each example's category
is its task, which picks its head (and, with SpecDrop, its experts). The MoE is
residual, its experts LoRA adapters (rank 8) over one frozen shared projection,
routed per token; the head sees the mean of the valid tokens. Logits are padded
to the widest task with -inf, so one cross-entropy serves every task.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


class TextMoE(nn.Module):
    def __init__(self, moe: nn.Module, task_classes, hidden_size: int = 384):
        super().__init__()
        self.moe = moe
        self.heads = nn.ModuleList(nn.Linear(hidden_size, n) for n in task_classes)
        self.widest = max(task_classes)
        self.class_category = None  # categories are tasks, not groups of classes

    def forward(self, x: Tensor, categories: Tensor) -> tuple[Tensor, Tensor]:
        if categories is None:
            raise ValueError("TextMoE needs each example's task id as its category")
        x = x.float()
        padding = x.abs().sum(-1) == 0
        h, aux = self.moe(x, categories=categories, padding_mask=padding)
        valid = (~padding).unsqueeze(-1).to(x.dtype)
        pooled = ((x + h) * valid).sum(1) / valid.sum(1).clamp_min(1)
        logits = pooled.new_full((x.shape[0], self.widest), float("-inf"))
        for task, head in enumerate(self.heads):
            rows = (categories == task).nonzero().squeeze(1)
            if rows.numel():
                logits = logits.index_put((rows.unsqueeze(1), torch.arange(head.out_features)), head(pooled[rows]))
        if x.shape[0] == 0:  # no head ran: keep the MoE in the graph, its backward's exchanges are every rank's
            logits = logits + pooled.sum() * 0.0
        return logits, aux
