"""One training run's runtime: the device, the process group, the topology and placement, and the
engine (``dist_moe.train.step.engines``) that builds its MoE layers and steps."""
from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
from torch import nn

from dist_moe.dispatch.exchange import ExchangeConfig
from dist_moe.distributed.groups import WeakGroup
from dist_moe.distributed.process_group import init_from_env, launched_world_size, resolve_device, shutdown
from dist_moe.distributed.rank_line import say_rank_line
from dist_moe.distributed.reductions import all_reduce_sum
from dist_moe.moe.experts import experts_path
from dist_moe.moe.layer import MoELayerConfig
from dist_moe.train.expert_groups import ExpertGroups
from dist_moe.train.layer_config import exchange_config
from dist_moe.train.precision import compute_context, restore, run_precision, set_up
from dist_moe.train.run_config import ParallelConfig
from dist_moe.train.step.engines import ENGINES
from placement import Placement, Topology
from placement.ep_groups import ExpertLayout


class Runtime:
    """Process group, engine set-up and the MoE layer factory for one training run."""

    group = WeakGroup()  # held weakly (dist_moe/distributed/groups.py)

    def __init__(self, engine: str, parallel: ParallelConfig, precision: str = "fp32", deterministic: bool = False,
                 gar: bool = False):
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {tuple(ENGINES)}, got {engine!r}")
        self.engine = ENGINES[engine]()  # what differs between torch, deepspeed and megatron (train/step/engines.py)
        self.engine.check_version()
        self.parallel = parallel
        self.deterministic = deterministic  # train.deterministic
        self.timeout_s = parallel.timeout_s
        self._owns_group = not torch.distributed.is_initialized()  # a caller's group is left to the caller
        # first of all: the device (LOCAL_RANK's GPU, or the CPU); the backend follows from it
        self.device = resolve_device(parallel.device)
        self.precision = run_precision(precision, self.device, gar)  # train.precision (auto resolved here)
        self._settings = set_up(self.device, deterministic)
        self._defaulted = _one_rank_defaults() if self.engine.needs_group else []
        self.engine.before_group(self.timeout_s, self.device)
        self.rank, self.world, self.group = init_from_env(self.timeout_s, always=self.engine.needs_group,
                                                          device=self.device)
        # on a GPU, which way the experts compute: torch's fast grouped GEMM, or a loop in another dtype or GPU
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        say_rank_line(self.rank, self.world, self.device, self.group,
                      experts_path(self.device, dtype) if self.device.type == "cuda" else None)
        _share_cpu_threads()
        # a topology that disagrees with the launch, or EP groups that do not fit it, fail here, on every rank
        self.layout = ExpertLayout(self.topology(), parallel.ep_size or self.world, parallel.ep_layout)
        self.experts = (ExpertGroups(self.layout, self.rank, datetime.timedelta(seconds=self.timeout_s))
                        if self.layout.replicas > 1 else None)
        note = node_dedup_inside_a_node(parallel.dedup, self.layout)
        if note and self.is_main:
            print(f"dist-moe: {note}", file=sys.stderr)
        self.engine.after_group(self)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def topology(self) -> Topology:
        return Topology.launched(self.world)

    @property
    def ep_size(self) -> int:
        return self.layout.ep_size

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group."""
        return self.experts.ep_ranks.index(self.rank) if self.experts is not None else self.rank

    def ep_topology(self) -> Topology:
        """The topology this rank's EP group sees (the launch's when the group is the world)."""
        return self.experts.topology if self.experts is not None else self.topology()

    def placement(self, num_experts: int) -> Placement:
        """Which rank of an EP group holds which expert: the same in every replica."""
        kind, ep = self.parallel.placement, self.ep_size
        if kind.endswith((".yaml", ".yml")):  # written by `dist-moe place --out`
            placement = Placement.from_yaml(kind)
            if (placement.num_experts, placement.world_size) != (num_experts, ep):
                groups = "" if ep == self.world else f" in each expert-parallel group (parallel.ep_size={ep})"
                raise ValueError(f"parallel.placement={kind!r} places {placement.num_experts} experts on "
                                 f"{placement.world_size} ranks, but this run has {num_experts} experts on "
                                 f"{ep} ranks{groups}")
            return placement
        return Placement.named(kind, num_experts, self.ep_topology())

    @property
    def exchange(self) -> ExchangeConfig:
        """How this run's MoE layers exchange their tokens where dist-moe's dispatcher moves them."""
        return exchange_config(self.parallel, self.deterministic)

    @property
    def moe_group(self):
        """The expert-parallel group of this run's MoE layers (None: one rank, every expert here)."""
        if self.experts is not None:
            return self.experts.ep if self.ep_size > 1 else None
        return self.group if self.world > 1 else None

    @property
    def stats_group(self):
        """Where the routers' statistics (BRANCH anchors, DeepSeek-V3 loads) sum: every rank's batch, so
        every replica keeps the same router state."""
        return self.group if self.world > 1 else None

    def build_moe(self, config: MoELayerConfig) -> nn.Module:
        """One MoE layer, built by the engine, its experts placed by ``parallel.placement``."""
        return self.engine.build_moe(self, config)

    def stepper(self, model: nn.Module, lr: float, max_grad_norm, micro_batch: int):
        return self.engine.stepper(self, model, lr, max_grad_norm, micro_batch)

    def compute(self):
        """The context a forward runs in (``train.precision``)."""
        return compute_context(self.device, self.precision)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t, self.group if self.world > 1 else None)

    def shutdown(self, failed: bool = False) -> None:
        """Tear down what this run set up. After a failure there is no closing barrier: a dead
        or cut-off peer would make it wait out the timeout a second time."""
        self.engine.shutdown()
        restore(self._settings)  # TF32 and deterministic mode as the process had them
        if self._owns_group:
            shutdown(wait=not failed)
        for key in self._defaulted:  # a later run (or a child process) must not inherit this run's port
            os.environ.pop(key, None)


def node_dedup_inside_a_node(dedup: str, layout: ExpertLayout) -> str | None:
    """What a run says once when its EP groups each sit inside one node of several and it asks for node dedup:
    no exchange crosses a node boundary, so node dedup runs as rank dedup (the same bytes)."""
    if dedup != "node" or layout.replicas == 1 or layout.ep_size == 1:
        return None
    if layout.group_topology(0).num_nodes == 1 < layout.topology.num_nodes:
        return (f"parallel.dedup=node: each expert-parallel group of {layout.ep_size} ranks sits inside one node, "
                "so its exchanges cross no node boundary and node dedup runs as rank dedup")
    return None


def _share_cpu_threads() -> None:
    """Unless OMP_NUM_THREADS says otherwise, the ranks of a node share the cores this process may
    run on, less one left to the rest of the machine, and never take more threads than torch's
    default (a thread per physical core). torch's default splits every op over all cores and
    waits for the slowest thread, so with one of 2 cores busy elsewhere the plain `dist-moe
    train` trained 3-5x slower (README); the deepspeed launcher sets nothing either, and 2
    ranks x 2 threads on 2 cores ran 5x slower than 1 thread each (torchrun sets 1)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(min(torch.get_num_threads(), max(1, (cores - 1) // max(local, 1))))


def _one_rank_defaults() -> list[str]:
    """DeepSpeed and Megatron need a process group even alone: a one-rank group on localhost.
    Returns the variables it set (the run removes them at shutdown)."""
    if launched_world_size() != 1:
        return []

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    defaults = (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)))
    set_here = [key for key, _ in defaults if key not in os.environ]
    for key, value in defaults:
        os.environ.setdefault(key, value)
    return set_here
