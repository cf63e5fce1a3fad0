"""Who steps: zero_grad, backward, gradient reduction, clip and the optimizer step of one batch.

``LocalStepper`` is dist-moe's (engines torch and megatron): replicated parameters are
all-reduced and divided by the world, rank-local experts (whose gradients already hold every
rank's tokens) are divided by the world, then one clip over the global norm. ``DeepSpeedStepper``
hands all of it to ``deepspeed.initialize``'s engine.
"""
from __future__ import annotations

import torch
from torch import nn

from dist_moe.dispatch.grads import all_finite, clip_global, group_size, scale_grads, sum_replicated_grads
from dist_moe.dispatch.groups import WeakGroup
from dist_moe.gar.step import rank_local_param_ids
from dist_moe.moe_view import moe_views


class LocalStepper:
    """zero_grad, backward, data-parallel average, global clip, Adam step."""

    finish_external = None  # GAR reduces, clips and steps itself (DeepSpeedStepper hands that to DeepSpeed)

    group = WeakGroup()  # held weakly (dist_moe/dispatch/groups.py)

    def __init__(self, model: nn.Module, lr: float, max_grad_norm, group, world: int):
        self.module = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(self.params, lr=lr)
        self.local = rank_local_param_ids(moe_views(model))
        self.group, self.world, self.max_grad_norm = group, world, max_grad_norm

    def __call__(self, loss: torch.Tensor) -> bool:
        """One step; False (and no update) when the loss or any rank's gradients are not finite."""
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.group is not None:
            sum_replicated_grads(self.params, self.local, self.group)
            for p in self.params:  # the data-parallel average
                if p.grad is not None:
                    p.grad.div_(self.world)
        if not all_finite(loss, self.params, self.group):
            self.opt.zero_grad(set_to_none=True)
            return False
        if self.max_grad_norm:
            clip_global(self.params, self.local, self.group, self.max_grad_norm)
        self.opt.step()
        return True


class DeepSpeedStepper:
    """``deepspeed.initialize`` with MoE parameter groups; the engine runs backward and step."""

    def __init__(self, model: nn.Module, lr: float, max_grad_norm, micro_batch: int,
                 optimizer_cls=torch.optim.Adam):
        # deepspeed: an optional engine, imported only where it is used
        import deepspeed
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in model.parameters() if p.requires_grad], "name": "parameters"})
        config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": float(max_grad_norm or 0.0), "steps_per_print": 10**9}
        self.module, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer_cls(groups, lr=lr),
                                                           config=config)

    def __call__(self, loss: torch.Tensor) -> bool:
        """One step; False (no update) when the loss or any rank's gradients are not finite."""
        group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        self.module.backward(loss)  # reduces gradients: a NaN on one rank reaches every rank's check
        params = [p for p in self.module.module.parameters() if p.requires_grad]
        if not all_finite(loss, params, group):
            for p in params:
                p.grad = None
            return False
        self.module.step()
        return True

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
