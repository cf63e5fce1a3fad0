"""The training config's ``engine``: which MoE layer hosts the routing, and who steps.

torch      dist-moe's MoELayer and dispatcher (``parallel.dedup``, ``parallel.pipeline_chunks``);
           plain Adam (``steppers.LocalStepper``).
deepspeed  DeepSpeed's MoE layer with dist-moe's gate; ``deepspeed.initialize`` with MoE
           parameter groups owns backward, gradient reduction, clipping and the step; its tokens
           move through ``parallel.dispatcher``: DeepSpeed's capacity-padded all-to-all (engine),
           or dist_moe (dist-moe's dispatcher: ``parallel.dedup``, ``parallel.pipeline_chunks``).
megatron   Megatron-core's MoELayer with dist-moe's router; its tokens move through
           ``parallel.dispatcher``: Megatron's alltoall (engine) or allgather, or dist_moe (dist-moe's
           dispatcher: ``parallel.dedup``, ``parallel.pipeline_chunks``); plain Adam.
           The key defaults to auto: dist_moe when the config asks for node dedup or pipelined
           chunks (``ParallelConfig.dispatches``), else the engine's own.

``train.precision: bf16`` is each engine's own: DeepSpeed's ``bf16.enabled`` (bf16 module, fp32 masters
and Adam state in its optimizer; ``DeepSpeedStepper``); for megatron, as for torch, fp32 weights and
Adam state with the forward under autocast (Megatron's bf16 math: bf16 expert GEMMs, fp32 router and
combine).

Every engine shares each MoE layer's experts out over an expert-parallel group of ``parallel.ep_size``
ranks (default: the world), the groups holding replicas of them, and keeps the router, placement and
topology of the config (the placement per group, on the group's own topology). DeepSpeed and Megatron-core
build their groups from consecutive ranks (``parallel.ep_layout: contiguous``). An ``Engine`` is what differs between
them: what it sets up before and after the process group, the MoE layer it builds, its stepper
and what it tears down. ``ENGINES`` maps the config's names to them, as ``ROUTERS`` does routers.
"""
from __future__ import annotations

import datetime
import importlib.metadata
from dataclasses import replace

import torch
from torch import nn

from dist_moe.integrations.deepspeed import DeepSpeedHostedMoE, init_distributed
from dist_moe.integrations.deepspeed.patches import release_groups
from dist_moe.integrations.megatron import MegatronHostedMoE, seed_model_parallel_rng
from dist_moe.integrations.megatron import patches as megatron_patches
from dist_moe.integrations.megatron.patches import DISPATCHERS, release_parallel_state
from dist_moe.moe.layer import MoELayerConfig
from dist_moe.optional_engines import engine_import
from dist_moe.train.step.steppers import DeepSpeedStepper, LocalStepper

# the engine releases whose internals dist-moe's adapters and patches were written against
SUPPORTED = {"deepspeed": ("deepspeed", "0.19."), "megatron": ("megatron-core", "0.16.")}


class Engine:
    """The contract: set up (``before_group``, ``after_group``), build the MoE layer, step, shut down."""

    name = ""
    needs_group = True  # a process group even on one rank (a one-rank group on localhost)
    resume_keys: tuple[str, ...] = ()  # config keys beyond the model's whose change its checkpoints cannot carry


    def check_version(self) -> None:
        """Refuse a release the adapters were not written for (before any collective)."""
        if self.name not in SUPPORTED:
            return

        package, series = SUPPORTED[self.name]
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            raise ValueError(f"engine={self.name!r} needs {package} {series}x installed "
                             f"(pip install -e '.[{self.name}]')") from None
        if not version.startswith(series):
            raise ValueError(f"engine={self.name!r}: {package} {version} is installed, but dist-moe supports "
                             f"{series}x only (its adapters patch that release's internals)")

    def before_group(self, timeout_s: float, device) -> None:
        """What must happen before the process group exists."""

    def after_group(self, rt) -> None:
        """What needs the process group (``rt``: the ``Runtime``)."""

    def build_moe(self, rt, config: MoELayerConfig) -> nn.Module:
        """One MoE layer of ``config`` (``train/layer_config.py``'s, its exchange the run's) over the runtime
        ``rt``'s group, its experts placed by ``parallel.placement``."""
        raise NotImplementedError

    def stepper(self, rt, model: nn.Module, lr: float, max_grad_norm, micro_batch: int):
        return LocalStepper(model, lr, max_grad_norm, rt.group if rt.world > 1 else None, rt.world,
                            datetime.timedelta(seconds=rt.timeout_s), rt.experts)

    def shutdown(self) -> None:
        """Tear down what ``after_group`` set up (the process group is the runtime's)."""


class TorchEngine(Engine):
    name = "torch"
    needs_group = False

    def build_moe(self, rt, config):
        return config.build(rt.moe_group, rt.placement(config.num_experts), rt.ep_topology(), rt.stats_group)


class DeepSpeedEngine(Engine):
    name = "deepspeed"
    # DeepSpeed's bf16 holds the module in bf16 and its fp32 master weights in the optimizer; fp32 holds
    # the weights themselves: their checkpoints keep different tensors
    resume_keys = ("train.precision",)

    def before_group(self, timeout_s, device):
        init_distributed(timeout_s, device)

    def after_group(self, rt):
        _refuse_strided(rt, "DeepSpeed", "ep_size")

    def build_moe(self, rt, config):
        placement = rt.placement(config.num_experts)
        if rt.parallel.dispatches(self.name):  # DeepSpeed's MoE module and experts, dist-moe's dispatcher (dropless)
            config = replace(config, capacity_factor=None, exchange=replace(config.exchange, deterministic=False))
            return DeepSpeedHostedMoE(config, rt.ep_size, placement, rt.ep_topology(), dispatcher="dist_moe")
        return DeepSpeedHostedMoE(config, rt.ep_size, placement, rt.ep_topology(), min_capacity=4)  # MoE's default

    def stepper(self, rt, model, lr, max_grad_norm, micro_batch):
        return DeepSpeedStepper(model, lr, max_grad_norm, micro_batch, precision=rt.precision)

    def shutdown(self):
        release_groups()


class MegatronEngine(Engine):
    name = "megatron"
    seeded = False  # Megatron's model-parallel RNG streams (seed_model_parallel_rng), once per run

    def after_group(self, rt):
        _refuse_strided(rt, "Megatron-core", "expert_model_parallel_size")
        megatron_patches.apply(cpu=rt.device.type == "cpu")
        parallel_state = engine_import("megatron.core", "parallel_state")

        # every group Megatron creates waits parallel.timeout_s for a peer, as the world does; its expert-data-
        # parallel groups are the run's replica groups (both of consecutive EP groups)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=rt.ep_size,
                                                 distributed_timeout_minutes=rt.timeout_s / 60)

    def build_moe(self, rt, config):
        if not self.seeded:  # once: each seeding resets the streams (and the GPU's default generator)
            # the run's seed: the trainer seeded torch with it just before building the model
            seed_model_parallel_rng(torch.initial_seed())
            self.seeded = True
        placement = rt.placement(config.num_experts)
        config = replace(config, capacity_factor=None)  # dropless (the config checks refuse a capacity)
        if rt.parallel.dispatches(self.name):  # Megatron's layer and experts, dist-moe's dispatcher
            config = replace(config, exchange=replace(config.exchange, deterministic=False))
            return MegatronHostedMoE(config, rt.ep_size, placement, rt.ep_topology(), device=rt.device,
                                     dispatcher="dist_moe")
        own = rt.parallel.dispatcher  # auto or engine: Megatron's default, alltoall
        return MegatronHostedMoE(config, rt.ep_size, placement, rt.ep_topology(), device=rt.device,
                                 dispatcher=own if own in DISPATCHERS else "alltoall")

    def shutdown(self):
        release_parallel_state()


ENGINES: dict[str, type[Engine]] = {e.name: e for e in (TorchEngine, DeepSpeedEngine, MegatronEngine)}


def _refuse_strided(rt, engine: str, its_key: str) -> None:
    """The engines build their expert-parallel groups from consecutive ranks ({engine}'s ``{its_key}``)."""
    if rt.layout.replicas > 1 and rt.layout.layout == "strided":
        raise ValueError(f"parallel.ep_layout=strided: {engine} builds its expert-parallel groups of "
                         f"parallel.ep_size={rt.ep_size} from consecutive ranks ({its_key}); use "
                         "parallel.ep_layout=contiguous, or engine torch for strided groups")


def check_engine_version(engine: str) -> None:
    """``Engine.check_version`` of the named engine."""
    ENGINES[engine]().check_version()
