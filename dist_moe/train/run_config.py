"""The training config's schema, written once: a dataclass per section, each key with its type, its
default and, where the type alone does not say it, the rule its value keeps. ``RunConfig.from_dict``
parses and checks a whole config once, before any data, process group or run directory; what it
returns is what the trainer, ``Runtime``, the engines and the layers read (``cfg.train.lr``).

Adding a key is one line in its section (a field with its default and rule): YAML files, dotted
overrides, ``DEFAULT_CONFIG`` and the error naming the key follow from it. The router section is
the strategy's own typed config (``routing.registry.config_class``: its constructor's parameters),
``train.gar`` is ``GARConfig`` (null: no GAR). Files are read by ``train/config.py``. It imports no
implementation: the names and bounds its keys take come from ``dist_moe/config/choices.py``, not from
the modules that implement them (engines, models, dispatch, run directory); only the router and GAR
configs, which are the strategies' own.
"""
from __future__ import annotations

import os
import string
import warnings
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

from dist_moe.config.choices import (
    DEPRECATED_KEYS_REMOVED_IN,
    DEVICES,
    ENGINES,
    EXPERT_KINDS,
    LORA_ALPHA,
    LORA_RANK,
    MAX_CAPACITY_FACTOR,
    MAX_PIPELINE_CHUNKS,
    MAX_TIMEOUT_S,
    MEGATRON_EXPERT_KINDS,
    MIN_TIMEOUT_S,
    MODEL_KINDS,
    PRECISIONS,
    SHARED_EXPERT_ENGINES,
    SHARED_EXPERT_HIDDEN,
    WIRE_DTYPES,
)
from dist_moe.config.choices import MEGATRON_DISPATCHERS as DISPATCHERS
from dist_moe.config.hf_defaults import apply_hf_defaults, given_keys
from dist_moe.config.types import fits, hints, kinds, optional, wanted
from dist_moe.errors import did_you_mean, shown
from dist_moe.routing.gar import GARConfig
from dist_moe.routing.registry import GAR_MOVED, RouterConfig, RouterKeyError, router_config, router_shape
from placement.names import DEDUP_MODES, EP_LAYOUTS
from placement.names import NAMED as PLACEMENTS

DISPATCHER_CHOICES = ("auto", "dist_moe", "engine", *DISPATCHERS)
# the keys parallel.dispatcher replaced, one per engine, and what their values name now
OLD_DISPATCHER_KEYS = {"megatron_dispatcher": {"auto": "auto", "dist_moe": "dist_moe", "alltoall": "alltoall",
                                               "allgather": "allgather"},
                       "deepspeed_dispatcher": {"auto": "auto", "dist_moe": "dist_moe", "deepspeed": "engine"}}

# router keys a training config leaves to its layer (the hidden size) and its data (SpecDrop's categories)
GIVEN_LATER = ("hidden_size", "num_categories")


def key(default, want: str | None = None, ok=None):
    """A config key: its default and, unless its annotation says all, the rule (``ok``) its value keeps,
    named as ``want`` in the error."""
    return field(default=default, metadata={"rule": (want, ok)} if ok is not None else {})


def path_key(default, want: str = "a non-empty path", ok=lambda v: bool(v.strip()) and "\0" not in v):
    """A key that names a file or folder: an override takes its text verbatim (``output.dir=a #b`` is
    ``a #b``), where YAML would cut a comment, fold a newline or read ``~`` as null."""
    return field(default=default, metadata={"rule": (want, ok), "verbatim": True})


def one_of(default, choices: tuple):
    """A key whose values the owning module lists (the message names them)."""
    return key(default, f"one of {', '.join(choices)}", lambda v: v in choices)


def _positive(default):
    return key(default, "a positive int", lambda v: v >= 1)


@dataclass
class ParallelConfig:
    """Expert parallelism over the launched world (torchrun / deepspeed launcher; 1 process: local)."""

    # which rank holds which expert: contiguous blocks, round robin, tree-prefix (BRANCH's subtrees on the
    # topology's nodes), or a file written by dist-moe place (an optimized placement)
    placement: str = path_key("contiguous",
                              f"one of {', '.join(PLACEMENTS)} or a placement .yaml (dist-moe place --out)",
                              lambda v: v in PLACEMENTS or v.endswith((".yaml", ".yml")))
    # a token's copies: one per selected expert (none), one per destination rank, or one per destination node
    # (forwarded inside the node)
    dedup: str = one_of("rank", DEDUP_MODES)
    # who moves an engine's tokens (engine deepspeed or megatron; engine torch is dist-moe's own): dist_moe
    # (dist-moe's dispatcher: dedup, pipeline_chunks), engine (the engine's own: DeepSpeed's all-to-all, Megatron's
    # alltoall, or Megatron's allgather by that name), or auto: dist_moe when dedup is node, pipeline_chunks > 1
    # or wire_dtype is named, else the engine's own, which sends one copy per selected expert
    dispatcher: str = one_of("auto", DISPATCHER_CHOICES)
    # ranks per expert-parallel group: each MoE layer's experts are shared out over ep_size ranks, and the world
    # holds world / ep_size replicas of them, whose gradients are summed; null: the world (no replicas)
    # (auto: the layout dist-moe plan prices fastest for this run's model on the launched topology, said at start)
    ep_size: int | str | None = key(None, "a positive int, auto",
                                    lambda v: v == "auto" if isinstance(v, str) else v >= 1)
    # which ranks form a group: contiguous (consecutive ranks: inside a node when the group fits one, replicas
    # across nodes) or strided (every R-th rank, R the replicas: a group spread over the nodes, replicas side by side)
    ep_layout: str = one_of("contiguous", EP_LAYOUTS)
    # how long any collective may wait for a peer before every rank stops with an error (bounds: process_group)
    timeout_s: float = key(300.0, f"a number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S}] (a second to a week)",
                           lambda v: MIN_TIMEOUT_S <= v <= MAX_TIMEOUT_S)
    # auto: this process's GPU when one is visible, else the CPU; the backend follows
    device: str = one_of("auto", DEVICES)
    # C > 1 cuts each exchange into C token chunks in flight while experts run; auto: the first training steps
    # measure C in chunk_tuning.CANDIDATES where a node boundary is crossed, and the run keeps the fastest
    pipeline_chunks: int | str = key(1, f"an int in [1, {MAX_PIPELINE_CHUNKS}] or auto",
                                     lambda v: v == "auto" if isinstance(v, str) else 1 <= v <= MAX_PIPELINE_CHUNKS)
    # the dtype token rows travel in through dist-moe's dispatcher (both ways, forward and backward); auto: the
    # dtype the experts compute in (bf16 under train.precision bf16), fp32 or bf16 to name one; fp8: the forward
    # dispatch as e4m3 values with one fp32 scale per 128 of a row (H + 4 * ceil(H / 128) bytes), the rest bf16
    wire_dtype: str = one_of("auto", WIRE_DTYPES)

    def dispatches(self, engine: str) -> bool:
        """Whether ``engine``'s MoE layers exchange through dist-moe's dispatcher (which dedups by node and
        pipelines chunks) rather than the engine's own: always for torch; for deepspeed and megatron,
        ``dispatcher`` dist_moe, or auto when this section asks for what only dist-moe's dispatcher does
        (node dedup, pipelined chunks, a named wire dtype; auto chunks measure where dist-moe's dispatcher
        runs anyway)."""
        if engine == "torch":
            return True
        asked = self.pipeline_chunks not in (1, "auto") or self.wire_dtype != "auto"
        return self.dispatcher == "dist_moe" or (self.dispatcher == "auto" and (self.dedup == "node" or asked))

    @property
    def start_chunks(self) -> int:
        """The chunk count layers are built with (auto starts at 1 until measured)."""
        return 1 if self.pipeline_chunks == "auto" else self.pipeline_chunks


@dataclass
class DataConfig:
    # name "corpus": the multi-domain byte corpus (dist_moe/data/corpus.py) for model.kind lm, with seq_len and
    # per_domain sequences; "text_tasks": the multi-task text mixture for model.kind text (per_domain examples
    # per task, seq_len MiniLM tokens each); a local text file, folder of text files or .npy / .bin token file
    # (dist_moe/data/local_text.py) for model.kind lm; otherwise a keel dataset (the loader names the valid ones)
    name: str = path_key("magic", "a non-empty name or path")
    val_fraction: float = key(0.2, "a number in (0, 1)", lambda v: 0 < v < 1)  # rows held out for validation
    max_rows: int | None = key(None, "an int >= 10", lambda v: v >= 10)  # use the first rows only (null: all)
    # a coarse label per row (data.CATEGORY_SETS), required by specdrop routing; "domains": each
    # sequence's domain (corpus); "tasks": each example's task (text_tasks)
    categories: str | None = None
    seq_len: int = key(64, "an int >= 2", lambda v: v >= 2)  # tokens per sequence (corpus, text_tasks, text files)
    per_domain: int = _positive(2000)  # sequences per domain (corpus), examples per task (text_tasks)
    # the token width of a .bin token file (nanoGPT writes uint16, Megatron's GPT-2-sized vocabularies uint32)
    token_dtype: str = one_of("uint16", ("uint16", "uint32"))


@dataclass
class ModelConfig:
    # "tabular" (one MoE block between input and head), "image" (conv stem, then the same; for data.name
    # fashion_mnist), "lm" (tiny transformer, MoE FFN per layer; for data.name corpus), "text" (frozen
    # MiniLM states, LoRA-expert MoE, a head per task; for data.name text_tasks) or "hf" (the transformers
    # MoE model at model.path, its own router and experts; for a local text or token file; unless given: no router
    # section, no capacity factor, a batch of about 2,048 tokens, the run named after the model's folder)
    kind: str = one_of("tabular", MODEL_KINDS)
    # model.kind hf: a local transformers model folder (or its config.json); without weights it starts random
    path: str | None = path_key(None)
    ffn_hidden_size: int = _positive(32)  # each expert's hidden width
    # the MoE layer's width: tabular and image project their input to it (0: no projection); lm: the
    # transformer's width (> 0)
    d_model: int = key(0, "an int >= 0 (0: no input projection)", lambda v: v >= 0)
    # each expert keeps at most ceil(capacity_factor x tokens x top_k / experts) of a batch's copies, the
    # rest are dropped; null: dropless, the MoE layer's own default (a run's, 1.25, is the BRANCH paper's setup)
    capacity_factor: float | None = key(1.25, f"a number in (0, {MAX_CAPACITY_FACTOR:g}]",
                                        lambda v: 0 < v <= MAX_CAPACITY_FACTOR)
    expert_type: str = one_of("swiglu", EXPERT_KINDS)  # each expert's MLP (lora: low-rank experts, model.kind text)
    # the width of a dense SwiGLU expert every token also runs through, added to the routed experts' output
    # (0: none; engine torch only)
    shared_expert_hidden: int = key(SHARED_EXPERT_HIDDEN, "an int >= 0 (0: no shared expert)", lambda v: v >= 0)
    lora_rank: int = _positive(LORA_RANK)  # model.expert_type lora: the rank of each expert's low-rank adapter
    # model.expert_type lora: the adapters' output is scaled by lora_alpha / lora_rank
    lora_alpha: float = key(LORA_ALPHA, "a finite number > 0", lambda v: v > 0)
    post_norm: bool = False  # a LayerNorm after the MoE block (tabular, image)
    label_mask: bool = False  # mask the logits of classes outside the row's category (SpecDrop's dense control)
    layers: int = _positive(2)  # transformer layers (lm), each with an MoE FFN
    heads: int = _positive(4)  # attention heads (lm)

    def block_keys(self) -> dict:
        """What the one-block models (tabular, image) take beside their MoE layer."""
        return {"d_model": self.d_model, "post_norm": self.post_norm, "label_mask": self.label_mask}


@dataclass
class TrainConfig:
    epochs: int = _positive(20)  # passes over the training split (unless max_steps is set)
    batch_size: int = _positive(256)  # per rank, as DeepSpeed's train_micro_batch_size_per_gpu
    lr: float = key(1e-3, "a finite number > 0", lambda v: v > 0)  # Adam's learning rate
    max_grad_norm: float | None = key(1.0, "a finite number > 0", lambda v: v > 0)  # clip to it (null: no clip)
    log_every: int = _positive(10)  # steps between rows of metrics.jsonl
    max_steps: int | None = _positive(None)  # when set, the run's length in optimizer steps instead of epochs
    gar_group_size: int = _positive(32)  # rows per GAR observation group (train.gar_groups consecutive)
    schedule: str = key("step", "'step' or 'epoch'", lambda v: v in ("step", "epoch"))  # when SpecDrop advances
    # validation batches of batch_size rows per rank, as Megatron's --eval-iters: each validation pass and the
    # routing record read the first eval_batches x batch_size x ranks rows of the seeded validation split (the
    # same rows every pass); null: all of it
    eval_batches: int | None = _positive(100)

    def eval_rows(self, world: int) -> int | None:
        """The validation rows a pass reads (None: all)."""
        return None if self.eval_batches is None else self.eval_batches * self.batch_size * world
    gar: GARConfig | None = None  # GAR's settings {lambda, eps, mode, unit} (null: no GAR)
    # GAR observation groups of consecutive rows, or of one category (task) each, the latter formed
    # over every rank's rows under expert parallelism (the groups one process forms from the batch)
    gar_groups: str = one_of("consecutive", ("consecutive", "same_category"))
    # steps between DCP checkpoints under output.dir/checkpoints (null: none)
    checkpoint_every: int | None = _positive(None)
    # the newest checkpoints kept: after each save the older ones are removed, the one just written never (null: all)
    keep_checkpoints: int | None = _positive(None)
    resume: bool = False  # continue from the newest checkpoint in output.dir (none yet: start afresh)
    # a step whose loss or gradients are not finite is skipped (no update, router state restored);
    # the run stops once more than max_skipped_steps have been skipped (checked at each log step)
    max_skipped_steps: int = key(10, "an int >= 0", lambda v: v >= 0)
    # bf16: matmuls in bfloat16 under autocast; weights, gradients, optimizer state, routers and the combine fp32
    # (engine deepspeed: DeepSpeed's own bf16, bf16 weights with fp32 master copies and Adam state); auto: bf16
    # on a GPU (the grouped GEMMs' fast kernels are bf16's), fp32 on the CPU and under train.gar
    precision: str = one_of("auto", PRECISIONS)
    # torch's deterministic algorithms and order-fixed sums: a rerun repeats bit for bit (tested on the CPU; the
    # CUDA settings are written, not yet run on a GPU)
    deterministic: bool = False


@dataclass
class OutputConfig:
    # {name}: the config's name, plus any model-changing overrides of this run (+router.top_k=2); ~ expands
    dir: str = path_key("runs/{name}")
    tensorboard: bool = False  # also write TensorBoard scalars to <dir>/tensorboard (needs tensorboard)
    # a dir that already holds a run is refused unless train.resume continues it or this is true, which
    # replaces that run (dist-moe's own files only: rundir.RUN_FILES and RUN_DIRS) once the new run has
    # finished: it trains in <dir>/.next-run, the old run untouched until then (stopped before: still so)
    overwrite: bool = False


# BRANCH paper setup: E=16 SwiGLU experts, top-4, capacity factor 1.25, Adam lr 1e-3.
DEFAULT_ROUTER = {"type": "branch", "num_experts": 16, "top_k": 4}


@dataclass
class RunConfig:
    # the name is a directory under runs/: no separator or '..' may take it elsewhere
    name: str = path_key("demo", "a non-empty name without '/', '\\' or '..'",
                         lambda v: bool(v.strip()) and not any(c in v for c in ("/", "\\", "..", "\0")))
    seed: int = key(0, "an int in [0, 2**63 - 1]", lambda v: 0 <= v < 2**63)  # weights, data order, jitter
    # which MoE layer hosts the router: dist-moe's own ("torch"), DeepSpeed's or Megatron-core's
    engine: str = one_of("torch", ENGINES)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    # null: model.kind hf's model routes with its own router (hf_defaults.py)
    router: RouterConfig | None = field(default_factory=lambda: router_config(DEFAULT_ROUTER, GIVEN_LATER))
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    @classmethod
    def from_dict(cls, d: dict, warn: bool = True) -> RunConfig:
        """The config a (merged) mapping describes, every key checked; missing keys take their defaults.
        A ValueError names the first bad key (``config key 'train.lr' must be ...``)."""
        d = _move_router_gar(d, warn)
        d = _move_dispatcher_keys(d, warn)
        d = apply_hf_defaults(d, given_keys(d, "the config")) if isinstance(d, dict) else d
        cfg = _section(cls, d, "")
        _check_across(cfg)
        return cfg

    def to_dict(self, full: bool = False) -> dict:
        """The plain mapping (YAML, checkpoints); the router gives the keys that differ from its
        constructor's defaults unless ``full``."""
        return _plain(self, full)


def _section(cls, d, prefix: str):
    if not isinstance(d, dict):
        raise ValueError(f"config key {prefix.rstrip('.')!r} must be a mapping, got {shown(d)}")
    names = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(names), key=str)
    if unknown:
        raise ValueError(f"unknown config key {shown(prefix + str(unknown[0]))}"
                         f"{did_you_mean(unknown[0], names, prefix)}; valid keys here: {sorted(names)}")
    types = hints(cls)
    values = {}
    for name, f in names.items():
        where, hint = prefix + name, types[name]
        if name not in d:
            continue  # its default
        value = d[name]
        if RouterConfig in kinds(hint):
            values[name] = None if value is None else _router(value)
        elif GARConfig in kinds(hint):
            values[name] = None if value is None else GARConfig.from_dict(value, f"config key {where!r}")
        elif is_dataclass(hint):
            values[name] = _section(hint, value, where + ".")
        else:
            values[name] = _leaf(where, value, hint, f.metadata.get("rule"))
    return cls(**values)


def _leaf(where: str, value, hint, rule):
    if value is None and optional(hint):
        return None
    if not fits(value, hint) or (rule is not None and not rule[1](value)):
        want = rule[0] if rule else wanted(hint)
        raise ValueError(f"config key {where!r} must be {want}{' or null' if optional(hint) else ''}, "
                         f"got {shown(value)}")
    return float(value) if float in kinds(hint) else value


def _router(value) -> RouterConfig:
    if not isinstance(value, (dict, RouterConfig)) or (isinstance(value, dict) and "type" not in value):
        raise ValueError("config key 'router' must be a mapping with a 'type'")
    try:  # what can be checked before the data and the layer give the router the rest
        config = router_config(value, GIVEN_LATER)
        router_shape(config, GIVEN_LATER)
    except RouterKeyError as e:
        raise e.under("router") from None
    return config


def _check_across(cfg: RunConfig) -> None:
    """The rules that tie keys of different sections together."""
    output_dir(cfg)  # a field other than {name}, a ~user that does not exist
    _check_hf(cfg)
    if cfg.train.resume and cfg.output.overwrite:
        raise ValueError("train.resume=true continues the run in output.dir and output.overwrite=true removes it: "
                         "set one of them")
    if cfg.train.gar is not None:
        GARConfig.check_router(cfg.router.type)
        if cfg.train.precision == "bf16":  # its factorized observations and Gram math are fp32
            raise ValueError(f"train.gar trains in fp32 only: set train.precision: fp32 "
                             f"(got {cfg.train.precision!r})")
    if cfg.train.deterministic and cfg.parallel.pipeline_chunks == "auto":
        raise ValueError("parallel.pipeline_chunks=auto picks the chunk count by timing, which a rerun may not "
                         "repeat: a deterministic run (train.deterministic: true) takes a number")
    _check_engine_dispatch(cfg)
    _check_layer_options(cfg)


# the model keys that only dist-moe's own MoE layers read, with the value that asks nothing of them
LAYER_OPTIONS = {"shared_expert_hidden": SHARED_EXPERT_HIDDEN, "lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA}


def _check_layer_options(cfg: RunConfig) -> None:
    """A layer option that the run's layers would not read is refused, not silently dropped: LoRA's keys
    without LoRA experts, and what an engine's host does not build (DeepSpeed's and Megatron's layers hold
    no shared expert; Megatron's experts are its own MLPs); model.kind hf trains the model's own experts."""
    model = cfg.model
    asked = {k: getattr(model, k) for k, unset in LAYER_OPTIONS.items() if getattr(model, k) != unset}
    if model.kind == "hf" and asked:
        name, value = next(iter(asked.items()))
        raise ValueError(f"model.{name}={value} shapes dist-moe's own MoE layers; model.kind=hf trains the model's "
                         "own experts: remove it")
    lora = [k for k in asked if k.startswith("lora_")]
    if lora and model.expert_type != "lora":
        raise ValueError(f"model.{lora[0]}={asked[lora[0]]} is read by model.expert_type=lora only (model.expert_type "
                         f"is {model.expert_type!r})")
    if model.shared_expert_hidden and cfg.engine not in SHARED_EXPERT_ENGINES:
        raise ValueError(f"model.shared_expert_hidden={model.shared_expert_hidden}: engine {cfg.engine}'s MoE layer "
                         f"holds no shared expert; set it to 0, or use engine {' or '.join(SHARED_EXPERT_ENGINES)}")
    if cfg.engine == "megatron" and model.expert_type not in MEGATRON_EXPERT_KINDS:
        raise ValueError(f"model.expert_type={model.expert_type}: engine megatron's experts are Megatron-core's "
                         f"MLPs ({', '.join(MEGATRON_EXPERT_KINDS)}); use one of them, or engine torch or deepspeed")


def _check_hf(cfg: RunConfig) -> None:
    """model.kind hf trains the model's own router and experts, through dist-moe's dispatcher (engine torch)."""
    kind, path = cfg.model.kind, cfg.model.path
    if (kind == "hf") != (path is not None):
        raise ValueError("model.kind=hf needs model.path (a transformers model folder)" if kind == "hf" else
                         f"model.path={path!r} is read by model.kind=hf only (model.kind is {kind!r})")
    if kind != "hf":
        if cfg.router is None:
            raise ValueError("config key 'router' must be a mapping with a 'type' (null only under model.kind=hf, "
                             "whose model routes with its own router)")
        return
    if cfg.engine != "torch":
        raise ValueError(f"model.kind=hf trains through dist-moe's own engine: set engine: torch (got {cfg.engine!r})")
    if cfg.train.gar is not None:
        raise ValueError("model.kind=hf routes with the model's own router, which GAR cannot observe: "
                         "set train.gar: null")
    if cfg.router is not None:
        raise ValueError(f"model.kind=hf routes with the model's own router: remove the router section "
                         f"(router.type={cfg.router.type!r})")
    if cfg.model.capacity_factor is not None:
        raise ValueError(f"model.capacity_factor={cfg.model.capacity_factor}: model.kind=hf trains the model's own "
                         "experts dropless: remove it")


def _check_engine_dispatch(cfg: RunConfig) -> None:
    """Before any process group exists: what only dist-moe's dispatcher does, refused when the config
    names the engine's own (it would be silently ignored); dist-moe's dispatcher in an engine is dropless."""
    engine, parallel = cfg.engine, cfg.parallel
    key_, choice = "parallel.dispatcher", parallel.dispatcher
    if choice in DISPATCHERS and engine != "megatron":
        raise ValueError(f"parallel.dispatcher={choice!r} names one of Megatron's own dispatchers (engine megatron); "
                         f"engine {engine} takes auto, dist_moe or engine")
    if parallel.wire_dtype == "fp8" and cfg.train.gar is not None:
        raise ValueError("parallel.wire_dtype=fp8 rounds the experts' inputs, which train.gar's factor capture "
                         "records exactly: use auto, fp32 or bf16 with GAR")
    if engine == "torch":
        return
    if engine == "megatron" and cfg.model.capacity_factor is not None:  # Megatron's own dispatchers too
        raise ValueError(f"engine megatron runs dropless: set model.capacity_factor: null "
                         f"(got {cfg.model.capacity_factor})")
    if parallel.dispatches(engine):
        if cfg.model.capacity_factor is not None:
            raise ValueError(f"engine {engine} through dist-moe's dispatcher ({key_}: {choice}, with parallel.dedup="
                             f"{parallel.dedup}, parallel.pipeline_chunks={parallel.pipeline_chunks}) "
                             f"runs dropless: set model.capacity_factor: null (got {cfg.model.capacity_factor})")
        return
    if parallel.pipeline_chunks not in (1, "auto"):  # auto: nothing to pipeline through the engine's own
        raise ValueError(f"parallel.pipeline_chunks={parallel.pipeline_chunks} pipelines dist-moe's own "
                         f"dispatcher ({key_}: dist_moe or auto); {key_}: {choice} exchanges through the engine's own: "
                         "set it to 1")
    if parallel.dedup == "node":  # the engines' own dispatchers send one copy per (token, expert)
        raise ValueError(f"parallel.dedup=node is dist-moe's dispatcher's ({key_}: dist_moe or auto); {key_}: "
                         f"{choice} sends one copy per (token, expert)")
    if parallel.wire_dtype != "auto":  # the engines' own dispatchers send the activations' dtype
        raise ValueError(f"parallel.wire_dtype={parallel.wire_dtype} sets what dist-moe's dispatcher sends ({key_}: "
                         f"dist_moe); {key_}: {choice} exchanges in the engine's own dtype: set it to auto")


def _move_dispatcher_keys(d: dict, warn: bool) -> dict:
    """``parallel.megatron_dispatcher`` / ``parallel.deepspeed_dispatcher`` read as ``parallel.dispatcher``,
    until release ``DEPRECATED_KEYS_REMOVED_IN``, with a warning naming it (a checkpoint's saved config
    converts silently). Each old key's value is checked as it was; the run's engine's own key sets the
    new one; two that disagree are refused."""
    parallel = d.get("parallel") if isinstance(d, dict) else None
    if not isinstance(parallel, dict) or not any(k in parallel for k in OLD_DISPATCHER_KEYS):
        return d
    parallel = dict(parallel)
    engine = d.get("engine", "torch")
    for old, renamed in OLD_DISPATCHER_KEYS.items():
        if old not in parallel:
            continue
        value = parallel.pop(old)
        if not isinstance(value, str) or value not in renamed:
            raise ValueError(f"config key 'parallel.{old}' (deprecated: parallel.dispatcher) must be one of "
                             f"{', '.join(renamed)}, got {shown(value)}")
        new, applies = renamed[value], old == f"{engine}_dispatcher"
        if warn:  # another engine's key never applied: naming its new spelling would advise a refused value
            advice = (f"use 'parallel.dispatcher: {new}'" if applies else
                      f"it applies to engine {old.split('_')[0]} only, and this run's engine is {engine}: remove it")
            warnings.warn(f"config key 'parallel.{old}' is deprecated: {advice} (it will be refused from release "
                          f"{DEPRECATED_KEYS_REMOVED_IN})", FutureWarning, stacklevel=4)
        if new == "auto" or not applies:
            continue  # the default, or another engine's key: it never applied
        if parallel.get("dispatcher", "auto") not in ("auto", new):  # auto: the default a merged config holds
            raise ValueError(f"config keys 'parallel.{old}' and 'parallel.dispatcher' are both set: keep "
                             "parallel.dispatcher (the other is its deprecated name)")
        parallel["dispatcher"] = new
    return {**d, "parallel": parallel}


def _move_router_gar(d: dict, warn: bool) -> dict:
    """GAR's settings moved from ``router.gar`` to ``train.gar``: the old key still works, until release
    ``DEPRECATED_KEYS_REMOVED_IN``, with a warning naming the new one (a checkpoint saved before the move
    resumes silently)."""
    router = d.get("router") if isinstance(d, dict) else None
    if not isinstance(router, dict) or "gar" not in router:
        return d
    train = d.get("train") or {}
    if train.get("gar") is not None:
        raise ValueError("config keys 'router.gar' and 'train.gar' are both set: keep train.gar "
                         "(router.gar is its deprecated name)")
    if warn:
        warnings.warn(GAR_MOVED, FutureWarning, stacklevel=4)
    router = dict(router)
    return {**d, "router": router, "train": {**train, "gar": router.pop("gar")}}


def output_dir(cfg: RunConfig) -> Path:
    """A ``RunConfig``'s output.dir with ``{name}`` filled in and ``~`` expanded (never a literal ``./~``)."""
    raw = _fill_name(cfg.output.dir, cfg.name)
    path = os.path.expanduser(raw)
    if path.startswith("~"):
        raise ValueError(f"output.dir {raw!r}: {path.split('/')[0]!r} is no known user's home folder")
    return Path(path)


def _fill_name(template: str, name: str) -> str:
    """``template`` with each ``{name}`` replaced; any other field (``{name.__class__}``, ``{0}``, ``{name!r}``)
    or a lone brace is refused rather than formatted."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"config key 'output.dir' may use only {{name}}, got {shown(template)} ({e})") from None
    bad = ["{" + f + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
           for _, f, spec, conv in parts if f is not None and (f, spec, conv) != ("name", "", None)]
    if bad:
        raise ValueError(f"config key 'output.dir' may use only {{name}}, got {shown(template)} (found {bad[0]})")
    return "".join(text + (name if field is not None else "") for text, field, _, _ in parts)


def verbatim_keys(cls=None, prefix: str = "") -> set[str]:
    """The dotted keys whose override values are taken as written (``path_key``)."""
    out = set()
    for f in fields(cls or RunConfig):
        hint = hints(cls or RunConfig)[f.name]
        if is_dataclass(hint) and hint is not RouterConfig:
            out |= verbatim_keys(hint, f"{prefix}{f.name}.")
        elif f.metadata.get("verbatim"):
            out.add(prefix + f.name)
    return out


def _plain(obj, full: bool):
    if isinstance(obj, RouterConfig):
        return obj.to_dict(full)
    if isinstance(obj, GARConfig):
        return obj.to_dict()
    if is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name), full) for f in fields(obj)}
    return obj

