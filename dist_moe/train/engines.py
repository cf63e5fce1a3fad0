"""The training config's ``engine``: which MoE layer hosts the routing, and who steps.

torch      dist-moe's MoELayer and dispatcher (``parallel.dedup``); plain Adam.
deepspeed  DeepSpeed's MoE layer with dist-moe's gate; ``deepspeed.initialize``
           with MoE parameter groups owns backward, gradient reduction, clipping
           and the step.
megatron   Megatron-core's MoELayer (``parallel.megatron_dispatcher``: alltoall or
           allgather) with dist-moe's router; plain Adam.

Every engine puts all experts across the launched world (expert parallelism =
world size) and keeps the router, placement and topology of the config. For
torch and megatron the step averages gradients like data parallelism: replicated
parameters are all-reduced and divided by the world, rank-local experts (whose
gradients already hold every rank's tokens) are divided by the world, then one
clip over the global norm.
"""
from __future__ import annotations

import datetime
import os

import torch
from torch import nn

from dist_moe.dispatch.groups import WeakGroup
from dist_moe.dispatch.process_group import init_from_env, launched_world_size, resolve_device
from dist_moe.dispatch.grads import all_finite, clip_global, group_size, scale_grads, sum_replicated_grads
from dist_moe.dispatch.stats import all_reduce_sum
from dist_moe.gar.step import rank_local_param_ids
from dist_moe.moe_view import moe_views
from dist_moe.seeding import fork_rng
from placement import Placement, Topology

ENGINES = ("torch", "deepspeed", "megatron")
# the engine releases whose internals dist-moe's adapters and patches were written against
SUPPORTED = {"deepspeed": ("deepspeed", "0.19."), "megatron": ("megatron-core", "0.16.")}


def check_engine_version(engine: str) -> None:
    """Refuse an engine release the adapters were not written for (before any collective)."""
    if engine not in SUPPORTED:
        return
    import importlib.metadata

    package, series = SUPPORTED[engine]
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"engine={engine!r} needs {package} {series}x installed (pip install -e '.[{engine}]')") from None
    if not version.startswith(series):
        raise ValueError(f"engine={engine!r}: {package} {version} is installed, but dist-moe supports {series}x only "
                         "(its adapters patch that release's internals)")


class Runtime:
    """Process group, engine set-up and the MoE layer factory for one training run."""

    group = WeakGroup()  # held weakly (dist_moe/dispatch/groups.py)

    def __init__(self, engine: str, parallel: dict):
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        check_engine_version(engine)
        self.engine, self.parallel = engine, parallel
        self.timeout_s = float(parallel.get("timeout_s", 300.0))
        self._owns_group = not torch.distributed.is_initialized()  # a caller's group is left to the caller
        # first of all: the device (LOCAL_RANK's GPU, or the CPU); the backend follows from it
        self.device = resolve_device(parallel.get("device", "auto"))
        cpu = self.device.type == "cpu"
        self._defaulted = _one_rank_defaults() if engine != "torch" else []
        if engine == "deepspeed":
            from dist_moe.integrations.deepspeed import init_distributed

            init_distributed(self.timeout_s, self.device)
        self.rank, self.world, self.group = init_from_env(self.timeout_s, always=engine != "torch",
                                                          device=self.device)
        _share_cpu_threads()
        self.topology()  # a topology that disagrees with the launch fails here, on every rank, before training
        if engine == "megatron":
            from dist_moe.integrations import megatron_patches

            megatron_patches.apply(cpu=cpu)
            from megatron.core import parallel_state

            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                                     expert_model_parallel_size=self.world)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def topology(self) -> Topology:
        return Topology.launched(self.world)

    def placement(self, num_experts: int) -> Placement:
        kind = self.parallel["placement"]
        if kind == "tree_prefix":
            return Placement.tree_prefix(num_experts, self.topology())
        if kind.endswith((".yaml", ".yml")):  # written by `dist-moe place --out`
            placement = Placement.from_yaml(kind)
            if (placement.num_experts, placement.world_size) != (num_experts, self.world):
                raise ValueError(f"parallel.placement={kind!r} places {placement.num_experts} experts on "
                                 f"{placement.world_size} ranks, but this run has {num_experts} experts on "
                                 f"{self.world} ranks")
            return placement
        return getattr(Placement, kind)(num_experts, self.world)

    def build_moe(self, hidden: int, ffn: int, router: dict, capacity_factor, expert_type: str) -> nn.Module:
        from dist_moe.routing import build_router

        with fork_rng():  # a probe for the expert count: leave the seed's stream alone
            num_experts = build_router({"hidden_size": hidden, **router}).num_experts
        placement = self.placement(num_experts)
        chunks = self.parallel.get("pipeline_chunks", 1)  # other engines: refused by config.validate
        if self.engine == "torch":
            from dist_moe.layer import MoELayer

            return MoELayer(hidden, ffn, router, placement=placement, topology=self.topology(),
                            group=self.group if self.world > 1 else None, dedup=self.parallel["dedup"],
                            timeout=datetime.timedelta(seconds=self.timeout_s),
                            capacity_factor=capacity_factor, expert_type=expert_type, pipeline_chunks=chunks)
        if self.engine == "deepspeed":
            from dist_moe.integrations.deepspeed import DeepSpeedHostedMoE

            return DeepSpeedHostedMoE(hidden, ffn, router, self.world, placement, capacity_factor, expert_type,
                                      min_capacity=4, topology=self.topology())  # min: deepspeed MoE's default
        if capacity_factor is not None:
            raise ValueError("engine megatron runs dropless: set model.capacity_factor: null "
                             f"(got {capacity_factor})")
        from dist_moe.integrations.megatron import MegatronHostedMoE

        return MegatronHostedMoE(hidden, ffn, router, self.world, placement, self.parallel["megatron_dispatcher"],
                                 expert_type, device=self.device, topology=self.topology())

    def stepper(self, model: nn.Module, lr: float, max_grad_norm, micro_batch: int):
        if self.engine == "deepspeed":
            return DeepSpeedStepper(model, lr, max_grad_norm, micro_batch)
        return LocalStepper(model, lr, max_grad_norm, self.group if self.world > 1 else None, self.world)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t, self.group if self.world > 1 else None)

    def shutdown(self, failed: bool = False) -> None:
        """Tear down what this run set up. After a failure there is no closing barrier: a dead
        or cut-off peer would make it wait out the timeout a second time."""
        if self.engine == "megatron":
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        if self._owns_group:
            from dist_moe.dispatch.process_group import shutdown

            shutdown(wait=not failed)
        for key in self._defaulted:  # a later run (or a child process) must not inherit this run's port
            os.environ.pop(key, None)


def _share_cpu_threads() -> None:
    """Ranks that share a node share its cores: unless OMP_NUM_THREADS says otherwise, each takes
    its share (torchrun sets 1; the deepspeed launcher sets nothing, and 2 ranks x 2 threads on 2
    cores ran 5x slower than 1 thread each)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    if local > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def _one_rank_defaults() -> list[str]:
    """DeepSpeed and Megatron need a process group even alone: a one-rank group on localhost.
    Returns the variables it set (the run removes them at shutdown)."""
    if launched_world_size() != 1:
        return []
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    defaults = (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)))
    set_here = [key for key, _ in defaults if key not in os.environ]
    for key, value in defaults:
        os.environ.setdefault(key, value)
    return set_here


class LocalStepper:
    """zero_grad, backward, data-parallel average, global clip, Adam step."""

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
