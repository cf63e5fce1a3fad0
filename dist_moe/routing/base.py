"""The routing contract shared by every strategy.

A Router turns token representations into a Routing: a full distribution over
experts, the selected experts with their gates, an auxiliary loss and small
statistics. Routers never move tokens and never talk to a process group
themselves; statistics that must agree across data-parallel replicas are
summed through ``dist_moe.distributed.reductions.all_reduce_sum``.
"""
from __future__ import annotations

import contextlib
import numbers
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from dist_moe.dispatch.combine import take_rows
from dist_moe.distributed.groups import WeakGroup
from dist_moe.distributed.reductions import all_reduce_sum
from dist_moe.routing.buffers import buffers_of, put_back
from dist_moe.routing.input_checks import CATEGORY_RANGE, NOT_FINITE, check_row, describe, keep_first
from placement.names import MAX_EXPERTS


@dataclass
class Routing:
    probs: Tensor  # [T, E] float32, the strategy's full distribution over experts
    expert_idx: Tensor  # [T, K] int64, highest probability first; -1 marks a slot dropped by capacity
    gates: Tensor  # [T, K] weights applied to the selected experts' outputs (0 where dropped)
    aux_loss: Tensor  # scalar, already scaled by the strategy's coefficient
    stats: dict = field(default_factory=dict)  # at least "load": [E]

    def detached(self) -> Routing:
        """A copy that holds no autograd graph (safe to keep between steps and to deepcopy)."""
        return Routing(self.probs.detach(), self.expert_idx, self.gates.detach(), self.aux_loss.detach(),
                       dict(self.stats))

    def dense_gates(self) -> Tensor:
        """Gates scattered into [T, E] (zero for unselected or dropped experts)."""
        return _per_expert(self.expert_idx, self.gates, self.probs.shape[1])


def expert_load(expert_idx: Tensor, num_experts: int, weights: Tensor | None = None,
                valid: Tensor | None = None) -> Tensor:
    """Tokens (or gate mass with ``weights``) per expert; dropped slots (-1) and tokens outside
    ``valid`` ([T] bool, e.g. padding) are left out. Each token's weights laid out over the experts,
    then summed over tokens: no data-dependent shape (no host sync on a GPU), and a fixed order of
    summation where a scatter-add on a GPU would add the gate masses in any order."""
    w = (expert_idx >= 0).float() if weights is None else weights.detach().float() * (expert_idx >= 0)
    if valid is not None:
        w = w * valid.reshape(-1, 1)
    return _per_expert(expert_idx, w, num_experts).sum(0)


def _per_expert(expert_idx: Tensor, values: Tensor, num_experts: int) -> Tensor:
    """[T, K] values of distinct selected experts (a top-k; -1 dropped) laid out as [T, E], zero
    elsewhere: one write per (token, expert), so nothing accumulates. A dropped slot writes to a
    spare column, cut off."""
    column = torch.where(expert_idx >= 0, expert_idx, num_experts)
    out = values.new_zeros(expert_idx.shape[0], num_experts + 1).scatter(1, column, values)
    return out[:, :num_experts]


def pick(src: Tensor, idx: Tensor) -> Tensor:
    """``src.gather(1, idx)`` for distinct indices in each row (a top-k): the backward writes each
    gradient to its own place, where a gather's would scatter-add them (with atomics on a GPU)."""
    t, e = src.shape
    flat = (torch.arange(t, device=idx.device).unsqueeze(1) * e + idx).reshape(-1)
    return take_rows(src.reshape(-1), flat, flat, 1).reshape(idx.shape)


@runtime_checkable
class Scheduled(Protocol):
    """A router with a training schedule the trainer moves and logs (SpecDrop's constant-sum ramp)."""

    progress: Tensor  # [] float64, in [0, 1]

    def set_progress(self, fraction: float) -> None: ...


class Router(nn.Module):
    # True: input checks wait on the device for a reader that takes them (the trainer on a GPU, which reads them at
    # its log step); False: checked at once, a device assert on a GPU (routing/input_checks.py)
    defer_checks = False

    """Base class: validates inputs and holds the fields every strategy shares."""

    # what the strategy reads besides the hidden states: "categories" (SpecDrop) or "token_ids" (hash); the
    # layer passes whatever it has, a model supplies what its routers declare
    inputs: frozenset = frozenset()

    num_experts: int
    top_k: int
    stats_group = WeakGroup()  # held weakly: torch.distributed owns the group (distributed/groups.py)
    # what layers and engine hosts may ask of any router; a strategy that has one sets its own
    aux_loss_coeff: float = 0.0  # the scale already applied to the aux loss it returns
    capacity_factor: float | None = None  # its own capacity (Switch), which a layer's must not repeat
    node_limit: int | None = None  # node-limited routing: the layer gives it each node's experts
    num_categories: int | None = None  # the categories it routes by (SpecDrop)

    @property
    def needs_topology(self) -> bool:
        """A subtree limit by topology level (BRANCH) whose depths the layer has yet to resolve."""
        return False

    def set_expert_groups(self, expert_group: Tensor) -> None:
        """[E] each expert's node, for a router with ``node_limit`` (DeepSeek-V3's)."""
        raise NotImplementedError(f"{type(self).__name__} has no node limit")

    def resolve_subtree_levels(self, levels: tuple, sizes: tuple, tree_prefix: bool) -> None:
        """The tree depth of each topology level's units, for a router that ``needs_topology`` (BRANCH's)."""
        raise NotImplementedError(f"{type(self).__name__} has no subtree limit by level")

    def __init__(self, num_experts: int, top_k: int, stats_group=None):
        super().__init__()
        self.num_experts, self.top_k = check_shape(num_experts, top_k)
        self.stats_group = stats_group
        self._update_state = True
        self._caller_checks = False
        self.unread_check: Tensor | None = None  # a GPU's input checks, not read yet (routing/input_checks.py)

    # --- precision ---------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Routing math in fp32 under any autocast: a bf16 matmul changes which experts win
        (2-3% of top-2 choices moved in a CPU-autocast probe)."""
        x = args[0] if args else kwargs.get("x")
        with torch.autocast(x.device.type if isinstance(x, Tensor) else "cpu", enabled=False):
            return super().__call__(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        """``.to(device)`` moves the router's state buffers, but ``.half()`` / ``.bfloat16()``
        (DeepSpeed's bf16, Megatron's Float16Module) must not round them: BRANCH anchors drift
        and a 1e-3 DeepSeek-V3 bias step is lost once |bias| >= 0.5 in bf16. They keep their
        dtype, as Megatron's ``_maintain_float32_expert_bias`` keeps its expert bias."""
        kept = {n: b for n, b in self._buffers.items() if b is not None and b.is_floating_point()}
        out = super()._apply(fn, recurse)
        for name, old in kept.items():
            moved = self._buffers[name]
            if moved is not None and moved.dtype != old.dtype:
                self._buffers[name] = old.to(moved.device)
        return out

    # --- schedules ---------------------------------------------------------
    @property
    def scheduled(self) -> bool:
        """Whether the trainer moves this router's schedule (``set_progress``) as training goes."""
        return False

    def set_progress(self, fraction: float) -> None:
        """Training progress in [0, 1] for a scheduled router (SpecDrop); nothing moves elsewhere."""

    # --- state updates -------------------------------------------------
    @property
    def updates_state(self) -> bool:
        """True when this forward may move training state (anchors, biases, schedules)."""
        return self.training and self._update_state

    @contextlib.contextmanager
    def frozen_state(self):
        """Run forwards without moving router state (used to recompute routing, e.g. by GAR)."""
        previous, self._update_state = self._update_state, False
        try:
            yield self
        finally:
            self._update_state = previous

    @contextlib.contextmanager
    def checks_by_caller(self):
        """Skip the data-dependent input checks (NaN/Inf, category range) in these forwards.

        An expert-parallel layer makes them itself (``input_problem``) and agrees on them
        with its peers before any exchange: a rank that raised here alone would leave the
        group's collective order while its peers went on."""
        previous, self._caller_checks = self._caller_checks, True
        try:
            yield self
        finally:
            self._caller_checks = previous

    @contextlib.contextmanager
    def restored_on(self, *errors: type[BaseException]):
        """This router's buffers put back as they were when one of ``errors`` leaves the block (a
        refusal every rank agreed on), and the error goes on."""
        saved = buffers_of(self)
        try:
            yield self
        except errors:
            put_back(self, saved)
            raise

    def reduce_stats(self, t: Tensor) -> Tensor:
        """Sum small statistics over ``stats_group`` (identity when there is none)."""
        return all_reduce_sum(t, self.stats_group)

    # --- input checks ----------------------------------------------------
    def check_input(self, x: Tensor, hidden_size: int | None) -> Tensor:
        if not isinstance(x, Tensor) or x.dim() != 2:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"router input must be a [T, hidden] tensor, got shape {shape}")
        if hidden_size is not None and x.shape[1] != hidden_size:
            raise ValueError(f"router input hidden size {x.shape[1]} != hidden_size={hidden_size}")
        if not x.is_floating_point():
            raise ValueError(f"router input must be floating point, got {x.dtype}")
        if not self._caller_checks:
            finite = torch.isfinite(x)
            self._check(finite.all(), NOT_FINITE, lambda: ((~finite).any(dim=1).sum(), x.shape[0]))
        # Routing math runs in fp32 whatever the activation dtype (bf16 underflows masks).
        return x.float()

    def check_categories(self, categories, num_tokens: int, num_categories: int) -> Tensor:
        if categories is None:
            raise ValueError(f"{type(self).__name__} requires categories: a [T] int64 tensor of category ids")
        if not isinstance(categories, Tensor) or categories.dim() != 1 or categories.shape[0] != num_tokens:
            shape = tuple(categories.shape) if isinstance(categories, Tensor) else type(categories).__name__
            raise ValueError(f"categories must have shape [T]=[{num_tokens}], got {shape}")
        if categories.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise ValueError(f"categories must be an integer tensor, got {categories.dtype}")
        if self._caller_checks:  # an out-of-range id is reported by the caller; keep indexing safe
            return categories.long().clamp(0, num_categories - 1)
        if num_tokens:
            self._check(((categories >= 0) & (categories < num_categories)).all(), CATEGORY_RANGE,
                        lambda: (categories.min(), categories.max(), num_categories))
        if self.unread_check is not None:  # read later: meanwhile, index safely
            return categories.long().clamp(0, num_categories - 1)
        return categories.long()

    def _check(self, ok: Tensor, kind: int, values) -> None:
        """Raise the line a failed check says, at once (on a GPU: a device assert, whose message is lost). With
        ``defer_checks`` (a reader that takes them): keep the first failure on the device until its next read
        (``take_unread_check``)."""
        if self.defer_checks:
            self.unread_check = keep_first(self.unread_check, check_row(ok, kind, *values()))
            return
        try:  # the CPU's assert raises at once, without a read the host-sync counts would see
            torch._assert_async(ok, "MoE router input check failed")
        except RuntimeError:
            raise ValueError(describe([1, kind, *(int(v) for v in values()), 0, 0][:5])) from None

    def take_unread_check(self) -> Tensor | None:
        """The input checks kept on the device since the last call ([5], ``input_checks.check_row``), or None."""
        row, self.unread_check = self.unread_check, None
        return row

    def check_valid(self, valid, num_tokens: int) -> Tensor | None:
        """``valid`` [T] bool (False at padding) as a float mask, or None: padding is routed like
        any token but left out of the statistics (aux loss, loads, anchors, biases), as Megatron's
        routers leave it out."""
        if valid is None:
            return None
        if not isinstance(valid, Tensor) or valid.shape != (num_tokens,):
            shape = tuple(valid.shape) if isinstance(valid, Tensor) else type(valid).__name__
            raise ValueError(f"valid must be a [T]=[{num_tokens}] bool tensor, got {shape}")
        return valid.float()

    def forward(self, x: Tensor, categories: Tensor | None = None, token_ids: Tensor | None = None,
                valid: Tensor | None = None) -> Routing:
        raise NotImplementedError


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_shape(num_experts, top_k) -> tuple[int, int]:
    """(num_experts, top_k) as ints, or ValueError naming the bad one."""
    num_experts = positive_int("num_experts", num_experts)
    if num_experts > MAX_EXPERTS:  # refused before any [E, ...] tensor is allocated
        raise ValueError(f"num_experts must be at most {MAX_EXPERTS}, got {num_experts}")
    if not _is_int(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    return num_experts, int(top_k)


def positive_int(name: str, value, allow_none: bool = False):
    """``value`` as an int >= 1 (numpy ints welcome), or a ValueError naming ``name``."""
    if value is None and allow_none:
        return None
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def zero_aux(device) -> Tensor:
    return torch.zeros((), device=device)


def select_top_k(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k values and indices, highest first; ties go to the lower expert index."""
    # A stable sort rather than torch.topk: topk's tie order is unspecified, and
    # ties are common (hash, uniform, SpecDrop's leak weights).
    vals, idx = torch.sort(probs, dim=1, descending=True, stable=True)
    return vals[:, :k], idx[:, :k]

