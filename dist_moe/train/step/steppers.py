"""Who steps: zero_grad, backward, gradient reduction, clip and the optimizer step of one batch.

``LocalStepper`` is dist-moe's (engines torch and megatron): replicated parameters are
all-reduced while backward runs (``train/step/grad_overlap.py``) and divided by the world, rank-local
experts (whose gradients already hold their expert-parallel group's tokens) are summed over their
replica group, on a communicator of their own, while backward runs (when the EP group is smaller than
the world) and divided by the world, then one clip over the global norm and a fused Adam step, all on
the device. ``DeepSpeedStepper`` hands all of it
to ``deepspeed.initialize``'s engine. Both return the step's skip flag as a 0-dim tensor (1.0: the
loss or some gradient was not finite on some rank, and nothing was updated), which the trainer
reads only when it logs.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from dist_moe.distributed.groups import WeakGroup
from dist_moe.moe.view import moe_views
from dist_moe.optional_engines import engine_import
from dist_moe.train.step.gar_step import rank_local_param_ids
from dist_moe.train.step.grad_overlap import OverlappedGradSum, overlapped_grad_sum
from dist_moe.train.step.grads import all_finite, clip_to, global_norm, group_size, scale_grads
from placement.ep_groups import ring_sends


class LocalStepper:
    """zero_grad, backward (replicated gradients summed over ranks while it runs), data-parallel
    average, global clip, Adam step: all on the device. A step whose loss or gradients are not finite
    on any rank changes no weight (Adam's ``found_inf``), and nothing is read back to the host."""

    finish_external = None  # GAR reduces, clips and steps itself (DeepSpeedStepper hands that to DeepSpeed)

    group = WeakGroup()  # held weakly (dist_moe/distributed/groups.py)

    def __init__(self, model: nn.Module, lr: float, max_grad_norm, group, world: int, timeout=None, experts=None):
        """``experts``: the run's ``ExpertGroups`` when its expert-parallel groups are smaller than the world."""
        self.module = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        # fused: one kernel for all parameters, and the only Adam that skips a step on a device flag
        self.opt = torch.optim.Adam(self.params, lr=lr, fused=True)
        self.local = rank_local_param_ids(moe_views(model))
        self.group, self.world, self.max_grad_norm = group, world, max_grad_norm
        replicated = [p for p in self.params if id(p) not in self.local]
        self.sums = [overlapped_grad_sum(replicated, group, timeout)] if group is not None else []
        self.norm_group = group  # where the rank-local experts' squares sum: the ranks that hold the others
        own = [p for p in self.params if id(p) in self.local]
        self.replica_sum, self.experts = None, experts
        self.grad_sent: dict[str, int] = {}  # bytes the experts' gradient sums sent, by level, since taken
        if experts is not None:
            self.norm_group = experts.ep
            if own:
                self.replica_sum = OverlappedGradSum(own, experts.new_replica_group,
                                                     after=self.sums[0] if self.sums else None)
                self.sums.append(self.replica_sum)

    def __call__(self, loss: torch.Tensor) -> torch.Tensor:
        """One step. Returns a device scalar: 1.0 when the loss or any rank's gradients were not finite
        (the step changed nothing), else 0.0."""
        self.opt.zero_grad(set_to_none=True)
        for s in self.sums:
            s.arm()
        loss.backward()
        for s in self.sums:
            s.finish()
        if self.replica_sum is not None:
            self._count_replica_sums()
        if self.sums:
            torch._foreach_div_([p.grad for p in self.params if p.grad is not None], self.world)
        total = global_norm(self.params, self.local, self.norm_group, loss)  # NaN anywhere: NaN on every rank
        skipped = (~torch.isfinite(total)).float()
        if self.max_grad_norm:
            clip_to(self.params, total, self.max_grad_norm)
        self.opt.found_inf = skipped  # read by the fused Adam on the device
        try:
            self.opt.step()
        finally:
            del self.opt.found_inf
        return skipped

    def _count_replica_sums(self) -> None:
        """What this rank's share of each of this step's expert-gradient sums sent, by topology level, as a
        ring all-reduce over its replica group sends it (``placement.ep_groups.ring_sends``)."""
        ranks, topology = self.experts.replica_ranks, self.experts.layout.topology
        for elements, size in self.replica_sum.sizes:
            level, sent = ring_sends(ranks, ranks.index(self.experts.rank), elements, size, topology)
            if level is not None:
                self.grad_sent[level] = self.grad_sent.get(level, 0) + sent


def device_args(device: torch.device):
    """``deepspeed.initialize``'s ``args`` naming the model's GPU (None on the CPU): DeepSpeed's engine
    otherwise makes cuda:LOCAL_RANK the current device, which a task that a scheduler isolated to one GPU
    (CUDA_VISIBLE_DEVICES naming one device, LOCAL_RANK > 0) does not have: it trains on cuda:0."""
    if device.type != "cuda":
        return None
    return SimpleNamespace(device_rank=device.index if device.index is not None else torch.cuda.current_device())


class DeepSpeedStepper:
    """``deepspeed.initialize`` with MoE parameter groups; the engine runs backward and step.

    ``precision="bf16"`` is DeepSpeed's own bf16 (``"bf16": {"enabled": true}``): the engine casts the
    module's parameters to bf16 (buffers keep their dtype: the routers' state stays fp32) and, at ZeRO
    stage 0, steps through its FP16_Optimizer in bf16 mode: fp32 master weights and fp32 Adam state,
    bf16 gradients reduced and copied to the masters. Floating-point inputs are cast to bf16 on the way
    into the module, as DeepSpeed's fp16 ``auto_cast`` does for fp16 (it has no bf16 twin)."""

    def __init__(self, model: nn.Module, lr: float, max_grad_norm, micro_batch: int,
                 optimizer_cls=torch.optim.Adam, precision: str = "fp32"):
        deepspeed = engine_import("deepspeed")
        split_params_into_different_moe_groups_for_optimizer = engine_import(
            "deepspeed.moe.utils", "split_params_into_different_moe_groups_for_optimizer")

        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in model.parameters() if p.requires_grad], "name": "parameters"})
        config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": float(max_grad_norm or 0.0), "steps_per_print": 10**9,
                  "bf16": {"enabled": precision == "bf16"}}
        if precision == "bf16":  # every caller of the module (engine, evaluation, routing records) feeds bf16
            model.register_forward_pre_hook(_floats_to_bf16)
        self.module, self.opt, _, _ = deepspeed.initialize(args=device_args(_device_of(model)), model=model,
                                                           optimizer=optimizer_cls(groups, lr=lr), config=config)
        if precision == "bf16":  # what checkpoints read: the fp32 masters and Adam state per parameter
            self.opt = _MasterWeights(self.opt)

    def __call__(self, loss: torch.Tensor) -> torch.Tensor:
        """One step; returns 1.0 (and updates nothing) when the loss or any rank's gradients are not
        finite, else 0.0 (DeepSpeed's engine reads its own checks back; this reads one more)."""
        group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        self.module.backward(loss)  # reduces gradients: a NaN on one rank reaches every rank's check
        params = [p for p in self.module.module.parameters() if p.requires_grad]
        if not all_finite(loss, params, group):
            for p in params:
                p.grad = None
            return loss.new_ones(())  # on the loss's device, as LocalStepper's flag
        self.module.step()
        return loss.new_zeros(())

    def finish_external(self, params: list, local_ids: set, group) -> None:
        """Step on gradients accumulated outside ``engine.backward`` (GAR's per-group backwards).

        GAR's gradients are already those of the whole step: each rank holds its share of
        every unit, so replicated gradients sum to the union's and experts hold every
        rank's tokens. DeepSpeed's reduction divides every gradient by the data-parallel
        world (replicated ones after summing them, experts' to stay "unaffected by
        ep_size"), so all are scaled by the world first. Then the engine's own reduction,
        clip and step.
        """
        scale_grads(params, group_size(group))
        self.module.allreduce_gradients()
        self.module.step()


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _floats_to_bf16(module: nn.Module, args: tuple) -> tuple:
    """A forward pre-hook: the floating-point positional inputs in bf16 (category ids stay integers)."""
    return tuple(a.to(torch.bfloat16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


class _MasterWeights:
    """DeepSpeed's bf16 optimizer (0.19.8, ZeRO stage 0: FP16_UnfusedOptimizer, one fp32 master per
    parameter) as dist-moe's checkpoints read an optimizer: for each bf16 parameter of the module, Adam's
    fp32 state and its fp32 master weight (``master``), the optimizer's own tensors, so a load fills
    them in place and a resumed run steps on exactly the weights it saved."""

    def __init__(self, wrapped):
        self.wrapped = wrapped

    @property
    def param_groups(self) -> list[dict]:
        return [{"params": params} for params in self.wrapped.fp16_groups]

    @property
    def state(self) -> dict:
        adam, out = self.wrapped.optimizer, {}
        for params, masters in zip(self.wrapped.fp16_groups, self.wrapped.fp32_groups):
            for p, master in zip(params, masters):
                if master not in adam.state:  # Adam makes its state at the first step: zeros to load into
                    adam.state[master] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(master),
                                          "exp_avg_sq": torch.zeros_like(master)}
                out[p] = {**adam.state[master], "master": master}
        return out
