"""SpecDrop: fixed category-conditioned soft routing (section 3 of Wang et al., "SpecDrop:
Parameter-Free Category-Conditioned Routing for Modular Specialization").

Round-robin assignment A[c, k] = 1 iff k == c mod K (0-based). Weights
p_k(c) = A p_a + (1 - A) p_i are merged with the fixed, category-independent
denominator S = p_a + (K-1) p_i, so the routed coefficients p_k(c)/S sum to 1
(eq. 3-4); a shared expert, if any, is added after the merge by the layer.

Schedule (3.6): p_a ramps by cosine from S/K (uniform merge) to its target
over ``warmup_fraction`` of training while p_i = (S - p_a)/(K-1), so S stays
constant. Imbalance (3.5, eq. 5): gap_c = (p_a - p_i) ((1 - pi_c)/(1 - 1/M))^beta,
p_a^c = S/K + gap_c (K-1)/K, p_i^c = S/K - gap_c/K. Any configuration that
would need clipping (p_a^c > 1 or p_i^c < 0 at any point of the schedule) is
rejected at construction.

Variants: soft (deployed: deterministic weights in training and inference),
bernoulli (training masks m_k ~ Bernoulli(p_k(c)) over the same fixed S;
inference uses p_k(c)), hard (p_i = 0 once any warmup has ended: the warmup
still starts from the uniform merge), uniform (No-Routing: 1/K, no labels).

Progress: call ``set_progress(fraction)`` per step or per epoch, or give
``total_steps`` and the router counts its own training forwards (one per
optimizer step; the first forward runs at progress 0).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from dist_moe.routing.base import Router, Routing, expert_load, positive_int, select_top_k, zero_aux
from dist_moe.routing.hashing import hash_combine, uniform01

VARIANTS = ("soft", "bernoulli", "hard", "uniform")


class SpecDropRouter(Router):
    """SpecDrop: fixed, category-conditioned soft routing, no learned router: category c's assigned expert
    (c mod K) weighs ``p_assigned``, every other ``p_leak``, over a fixed denominator; variants soft,
    bernoulli, hard and uniform."""

    # buffers (register_buffer): typed here for the type checker, which sees Module attributes otherwise
    gap_scale: Tensor
    assigned_expert: Tensor
    progress: Tensor
    step: Tensor
    inputs = frozenset({"categories"})

    def __init__(
        self,
        num_experts: int,
        num_categories: int,
        p_assigned: float = 0.7,
        p_leak: float | None = None,
        variant: str = "soft",
        warmup_fraction: float = 0.0,
        total_steps: int | None = None,
        imbalance_beta: float = 0.0,
        category_freqs=None,
        top_k: int | None = None,
        seed: int = 0,
        hidden_size: int | None = None,
    ):
        super().__init__(num_experts, num_experts if top_k is None else top_k)
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        num_categories = positive_int("num_categories", num_categories)
        total_steps = positive_int("total_steps", total_steps, allow_none=True)
        k = self.num_experts
        if variant == "uniform":
            p_a = p_i = 1.0 / k
        else:
            p_a = float(p_assigned)
            p_i = 0.0 if variant == "hard" else (1.0 - p_a if p_leak is None else float(p_leak))
            if variant == "hard" and p_leak not in (None, 0, 0.0):
                raise ValueError(f"p_leak must be 0 (or unset) for variant='hard', got {p_leak!r}")
            if not 0.0 < p_a <= 1.0:
                raise ValueError(f"p_assigned must lie in (0, 1], got {p_assigned!r}")
            if not 0.0 <= p_i < p_a:
                raise ValueError(f"p_leak must lie in [0, p_assigned={p_a}), got {p_i!r}")
            if variant in ("soft", "bernoulli") and p_i == 0.0 and k > 1:
                raise ValueError(f"p_leak must be > 0 for variant={variant!r} (use variant='hard' for 0)")
        if not 0.0 <= float(warmup_fraction) <= 1.0:
            raise ValueError(f"warmup_fraction must lie in [0, 1], got {warmup_fraction!r}")
        if variant == "bernoulli" and self.top_k != num_experts:
            raise ValueError(f"variant='bernoulli' samples a mask over all experts: top_k must be {num_experts}")
        if not float(imbalance_beta) >= 0.0:
            raise ValueError(f"imbalance_beta must be >= 0, got {imbalance_beta!r}")

        self.num_categories: int = num_categories
        self.variant = variant
        self.p_a_target, self.p_i_target = p_a, p_i
        self.S = p_a + (k - 1) * p_i
        self.warmup_fraction = float(warmup_fraction)
        self.total_steps = total_steps
        self.imbalance_beta = float(imbalance_beta)
        self.seed = int(seed)
        self.hidden_size = hidden_size
        freqs = self._check_freqs(category_freqs)
        # (1 - pi_c) / (1 - 1/M) ** beta, per category; all ones when balanced or beta = 0
        if self.imbalance_beta == 0 or num_categories == 1:
            amp = torch.ones(num_categories, dtype=torch.float64)
        else:
            amp = ((1 - freqs) / (1 - 1 / num_categories)) ** self.imbalance_beta
        # Both tables follow from the config: not checkpoint state (a resume re-derives them, so a
        # crafted checkpoint cannot point a category at an expert that does not exist).
        self.register_buffer("gap_scale", amp.float(), persistent=False)
        self.register_buffer("assigned_expert", torch.arange(num_categories) % k, persistent=False)
        self.register_buffer("progress", torch.zeros((), dtype=torch.float64))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self._check_no_clipping(amp)

    # --- configuration checks --------------------------------------------
    def _check_freqs(self, freqs) -> Tensor:
        m = self.num_categories
        if freqs is None:
            if self.imbalance_beta > 0:
                raise ValueError("category_freqs is required when imbalance_beta > 0")
            return torch.full((m,), 1.0 / m, dtype=torch.float64)
        f = torch.as_tensor(freqs, dtype=torch.float64)
        if f.shape != (m,):
            raise ValueError(f"category_freqs must have {m} entries (num_categories), got shape {tuple(f.shape)}")
        if bool((f < 0).any()) or abs(float(f.sum()) - 1.0) > 1e-6:
            raise ValueError(f"category_freqs must be non-negative and sum to 1, got sum {float(f.sum()):.6g}")
        return f

    def _check_no_clipping(self, amp: Tensor) -> None:
        if self.variant == "hard" and self.imbalance_beta > 0:
            raise ValueError("imbalance_beta > 0 would give variant='hard' nonzero leak weights; use 'soft'")
        k, s = self.num_experts, self.S
        # The gap grows monotonically along the cosine ramp, so the end point bounds every step.
        gap = (self.p_a_target - self.p_i_target) * amp
        p_a_c = s / k + gap * (k - 1) / k
        p_i_c = s / k - gap / k
        bad = torch.nonzero((p_a_c > 1 + 1e-12) | (p_i_c < -1e-12)).flatten()
        if len(bad):
            c = int(bad[0])
            raise ValueError(
                f"imbalance_beta={self.imbalance_beta} needs clipping for category {c}: "
                f"p_a^c={float(p_a_c[c]):.4f}, p_i^c={float(p_i_c[c]):.4f} (valid range [0, 1]); "
                f"lower imbalance_beta or p_assigned"
            )

    # --- schedule ------------------------------------------------------------
    @property
    def scheduled(self) -> bool:
        """Moved by the trainer, unless it counts its own steps (``total_steps``)."""
        return self.total_steps is None

    def set_progress(self, fraction: float) -> None:
        """Position in training, 0 at the start and 1 at the end (per step or per epoch)."""
        if self.total_steps is not None:
            raise ValueError("this router counts its own steps (total_steps is set); "
                             "set_progress is for the other mode")
        fraction = float(fraction)
        if not (0.0 <= fraction <= 1.0) or math.isnan(fraction):
            raise ValueError(f"progress fraction must lie in [0, 1], got {fraction!r}")
        self.progress.fill_(fraction)

    def _scheduled(self) -> tuple[Tensor, Tensor]:
        """(p_a, p_i) as 0-dim float64 tensors on the router's device: the forward never reads the
        progress back to the host."""
        k, s = self.num_experts, self.S
        w = self.warmup_fraction
        progress = self.progress.double()
        if w == 0:
            ramp = torch.ones_like(progress)
        else:
            ramp = 0.5 * (1 - torch.cos(math.pi * torch.clamp(progress / w, max=1.0)))
        p_a = s / k + (self.p_a_target - s / k) * ramp
        p_i = (s - p_a) / (k - 1) if k > 1 else torch.zeros_like(p_a)
        return p_a, p_i

    def scheduled_weights(self) -> tuple[float, float]:
        """(p_a, p_i) at the current progress, before the imbalance rule."""
        p_a, p_i = self._scheduled()
        return float(p_a), float(p_i)

    def weight_table(self) -> Tensor:
        """[M, K] weights p_k(c) at the current progress (rows sum to S)."""
        k, s = self.num_experts, self.S
        p_a, p_i = self._scheduled()
        gap = (p_a - p_i) * self.gap_scale.double()
        p_a_c, p_i_c = s / k + gap * (k - 1) / k, s / k - gap / k
        table = p_i_c.unsqueeze(1).repeat(1, k)
        table[torch.arange(self.num_categories, device=table.device), self.assigned_expert] = p_a_c
        return table.float()

    def coefficients(self, c: int) -> Tensor:
        """[E] merge coefficients p_k(c)/S for category c."""
        if not 0 <= int(c) < self.num_categories:
            raise ValueError(f"category {c} out of range [0, {self.num_categories})")
        return self.weight_table()[int(c)] / self.S

    # --- forward -----------------------------------------------------------
    def forward(self, x: Tensor, categories: Tensor | None = None, token_ids: Tensor | None = None,
                valid: Tensor | None = None) -> Routing:
        x = self.check_input(x, self.hidden_size)
        t = x.shape[0]
        if self.variant == "uniform" and categories is None:
            categories = torch.zeros(t, dtype=torch.long, device=x.device)  # No-Routing uses no labels
        categories = self.check_categories(categories, t, self.num_categories)
        if self.updates_state:
            if self.total_steps is not None:  # steps completed so far: the first forward is at 0
                self.progress.copy_(torch.clamp(self.step.double() / self.total_steps, max=1.0))
            self.step += 1
        weights = self.weight_table().to(x.device)[categories]  # [T, K] p_k(c)
        probs = weights / self.S
        if self.variant == "bernoulli" and self.training:
            if token_ids is None:
                token_ids = torch.arange(t, device=x.device)
            experts = torch.arange(self.num_experts, device=x.device)
            u = uniform01(hash_combine(self.seed, self.step, token_ids.long().unsqueeze(1), experts))
            gates_dense = (u < weights).float() / self.S  # fixed denominator S, not the active count
        else:
            gates_dense = probs
        _, idx = select_top_k(probs, self.top_k)
        gates = gates_dense.gather(1, idx)
        stats = {"load": expert_load(idx, self.num_experts, weights=gates, valid=self.check_valid(valid, t)),
                 "dropped": 0}
        return Routing(probs=probs, expert_idx=idx, gates=gates, aux_loss=zero_aux(x.device), stats=stats)

    def extra_repr(self) -> str:
        p_a, p_i = self.scheduled_weights()
        return (
            f"variant={self.variant}, num_experts={self.num_experts}, num_categories={self.num_categories}, "
            f"S={self.S:.4g}, p_a={p_a:.4g}, p_i={p_i:.4g}, progress={float(self.progress):.3f}"
        )
