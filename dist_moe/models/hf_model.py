"""A user's transformers causal-LM MoE model for ``dist-moe train`` (``model.kind: hf``).

``model.path`` is a local transformers model folder (or its ``config.json``): with ``*.safetensors``
weights it loads them (never pickled weights, never the folder's own code, and every weight of the
model must be there), else it starts from random weights drawn with the run's seed (the same on every
rank). A weights file may be a link to a regular file outside the folder, as the Hugging Face hub cache
lays out its snapshots (links into its blobs): it is read as safetensors, tensors only, which must fit
the config. Its MoE blocks' experts are sharded over the launched world and dispatched by dist-moe
(``integrations/transformers/hosted.py``); everything else is the model's own and replicated.
``HFCausalLM`` gives the trainer its usual ``(logits, aux) = model(tokens, categories)``; ``export``
writes the trained model where ``AutoModelForCausalLM.from_pretrained`` reads it, tokenizer included.
"""
from __future__ import annotations

import contextlib
import errno
import shutil
import tempfile
from pathlib import Path

import torch
from torch import Tensor, nn

from dist_moe.distributed.every_rank import raise_on_every_rank
from dist_moe.errors import first_line
from dist_moe.integrations.transformers.hosted import HostedHFExperts, moe_blocks
from dist_moe.models.hf_config import check_config
from dist_moe.models.hf_export import os_errors_of_safetensors, settle_export, swap_in
from dist_moe.models.rust_panic import rust_panics, rust_stderr_held
from dist_moe.optional_engines import engine_import

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# weight files transformers or other tools write that dist-moe does not read (pickles, other formats)
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
# what transformers raises for a folder it cannot use (a bad or missing file, a missing optional package)
LOAD_ERRORS = (ValueError, OSError, KeyError, TypeError, RuntimeError, ImportError)


def model_folder(path: str) -> Path:
    """The model folder ``model.path`` names (a folder with a config.json, or that config.json)."""
    p = Path(path).expanduser()
    if p.is_file() and p.name == "config.json":
        return p.parent
    if not p.exists():
        raise ValueError(f"model.path={path!r}: no such file or folder")
    if not p.is_dir() or not (p / "config.json").is_file():
        raise ValueError(f"model.path={path!r} must be a transformers model folder holding a config.json, or that "
                         "config.json")
    return p


def has_weights(folder: Path) -> bool:
    """Whether the folder holds safetensors weights; weights in any other format alone are refused."""
    if any(folder.glob("*.safetensors")):
        return True
    other = sorted(p.name for p in folder.iterdir() if p.suffix in OTHER_WEIGHTS)
    if other:
        raise ValueError(f"model.path={str(folder)!r} holds weights dist-moe does not load ({other[0]}: pickled "
                         "weights can run code when loaded): save the model as safetensors "
                         "(model.save_pretrained(folder)) first")
    return False


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


@contextlib.contextmanager
def transformers_quiet(progress: bool = True):
    """transformers logs errors only inside this block (and shows no progress bar unless ``progress``):
    its load report and its notices about a user's files would come before the one line that
    refuses them, and say less."""
    logging = engine_import("transformers.utils", "logging")
    level, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    if not progress:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bar and not progress:
            logging.enable_progress_bar()


def load_config(folder: Path):
    """The folder's transformers config: a model transformers knows without the folder's code, not quantized,
    with sizes a model can be built from (``check_config``)."""
    AutoConfig = engine_import("transformers", "AutoConfig")
    StrictDataclassError = engine_import("huggingface_hub.errors", "StrictDataclassError")

    try:
        with transformers_quiet():
            config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except StrictDataclassError as e:  # a value of the wrong type: its message names field and value
        raise ValueError(f"model.path={str(folder)!r}: transformers cannot read its config.json "
                         f"({' '.join(str(e).split())})") from None
    except LOAD_ERRORS as e:
        raise ValueError(f"model.path={str(folder)!r}: transformers cannot read its config.json ({first_line(e)})") \
            from None
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError(f"model.path={str(folder)!r} is a quantized checkpoint (quantization_config): dist-moe trains "
                         "fp32 weights; give a folder with unquantized weights")
    check_config(folder, config)
    return config


def load_tokenizer(folder: Path):
    """The folder's tokenizer, without the folder's code."""
    AutoTokenizer = engine_import("transformers", "AutoTokenizer")
    try:
        with transformers_quiet(), rust_stderr_held():
            return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except (Exception, *rust_panics()) as e:  # tokenizers raises plain Exceptions for a file it cannot read
        raise ValueError(f"model.path={str(folder)!r}: its tokenizer cannot be loaded ({first_line(e)})") from None


def token_ids(tokenizer, text: str, folder: Path, source: Path) -> list[int]:
    """``text`` (from the file ``source``) through the folder's tokenizer; a panic inside tokenizers (a
    pre-tokenizer's regular expression that backtracks without end) is the folder's fault, in one line."""
    try:
        with rust_stderr_held():
            return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    except rust_panics() as e:
        raise ValueError(f"model.path={str(folder)!r}: its tokenizer broke down on {str(source)!r} (tokenizers "
                         f"panicked: {first_line(e)})") from None


def load_model(folder: Path, seed: int) -> nn.Module:
    """The folder's causal LM in fp32: its weights, every one of them, or (none saved) random ones drawn
    from ``seed``."""
    AutoModelForCausalLM = engine_import("transformers", "AutoModelForCausalLM")
    SafetensorError = engine_import("safetensors", "SafetensorError")

    config = load_config(folder)
    info = None
    try:
        # a misfit weight is kept as a mismatch, not raised: _check_loaded names it and its shapes
        with transformers_quiet():
            if has_weights(folder):
                model, info = AutoModelForCausalLM.from_pretrained(
                    folder, local_files_only=True, trust_remote_code=False, use_safetensors=True,
                    dtype=torch.float32, output_loading_info=True, ignore_mismatched_sizes=True)
            else:
                torch.manual_seed(seed)
                model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
    except (*LOAD_ERRORS, SafetensorError) as e:
        raise ValueError(f"model.path={str(folder)!r}: transformers cannot build a causal LM from it "
                         f"({first_line(e)})") from None
    if info is not None:
        _check_loaded(folder, info)
    if not moe_blocks(model):
        raise ValueError(f"model.path={str(folder)!r} is a {type(model).__name__} without MoE blocks dist-moe can host "
                         "(a router beside stacked `experts` weights, as Mixtral, Qwen3-MoE, DeepSeek-V3 have)")
    return model.train()


def _check_loaded(folder: Path, info: dict) -> None:
    """Refuse a checkpoint that does not fill the model: transformers would start the rest from random."""
    for what in ("missing_keys", "mismatched_keys", "unexpected_keys"):
        found = sorted(info.get(what) or (), key=str)
        if found:
            # a mismatch is (key, shape in the file, shape the config gives)
            first = found[0] if isinstance(found[0], str) else \
                f"{found[0][0]} of shape {list(found[0][1])} where the config gives {list(found[0][2])}"
            raise ValueError(f"model.path={str(folder)!r}: its weights do not fit its config.json ({len(found)} "
                             f"{what.replace('_', ' ')}, e.g. {first})")


def parameter_count(folder: Path) -> tuple[int, int]:
    """(dense parameters, expert parameters) of the folder's model, counted without allocating it."""
    AutoModelForCausalLM = engine_import("transformers", "AutoModelForCausalLM")
    config = load_config(folder)
    try:
        with torch.device("meta"), transformers_quiet():
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except LOAD_ERRORS as e:
        raise ValueError(f"model.path={str(folder)!r}: transformers cannot build a causal LM from it "
                         f"({first_line(e)})") from None
    experts = sum(p.numel() for block, _ in moe_blocks(model) for p in block.experts.parameters())
    return sum(p.numel() for p in model.parameters()) - experts, experts


class HFCausalLM(nn.Module):
    """``(logits [B, S, V], aux) = model(tokens [B, S], categories=None)`` for the trainer; ``aux`` is the
    model's own router loss times its ``router_aux_loss_coef`` when its config asks for it
    (``output_router_logits``), else 0. ``tokenizer`` (``load_tokenizer``'s, or None) is kept from the
    start and exported with the model: the folder's files may be gone by the time training ends."""

    def __init__(self, hf: nn.Module, folder: Path, tokenizer=None):
        super().__init__()
        self.hf = hf
        self.folder = folder
        self.tokenizer = tokenizer
        self.class_category = None  # categories come from the data, not from classes
        self.aux_coef = float(getattr(hf.config, "router_aux_loss_coef", 0.0) or 0.0)

    def forward(self, tokens: Tensor, categories: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # a rank without rows (an epoch's last, short batch) still takes part in every MoE layer's exchange:
        # one stand-in row runs, and neither its logits nor its router loss reach the result
        empty = tokens.shape[0] == 0
        out = self.hf(input_ids=tokens.new_zeros(1, tokens.shape[1]) if empty else tokens, use_cache=False)
        aux = getattr(out, "aux_loss", None)
        aux = self.aux_coef * aux.float() if aux is not None else out.logits.new_zeros((), dtype=torch.float32)
        return (out.logits[:0], aux * 0.0) if empty else (out.logits, aux)

    def export_state(self, is_main: bool) -> dict[str, Tensor] | None:
        """The model's state as transformers saves it, every expert gathered, on the CPU of the main rank
        (every rank calls this: the gathers are collective; the others keep nothing and get None)."""
        hosts = {name: m for name, m in self.hf.named_modules() if isinstance(m, HostedHFExperts)}
        gathered = {f"{name}.{slot}" for name, m in hosts.items() for slot in m.expert_slots}
        state: dict = {}
        on_cpu: dict[int, Tensor] = {}  # one copy per storage: tied weights stay tied
        for key, t in self.hf.state_dict().items():
            if is_main:  # this rank's expert rows are not copied: every rank's, gathered below, take their place
                state[key] = None if key in gathered else on_cpu.setdefault(t.data_ptr(), t.detach().cpu())
        for name, m in hosts.items():
            for slot, full in m.full_expert_tensors(keep=is_main):
                state[f"{name}.{slot}"] = full
        return state if is_main else None

    def export(self, target: Path, is_main: bool, group=None) -> None:
        """Gather the model to the main rank and ``write`` it there. Every rank calls this (the gathers are
        collective) and every rank ends as the write did: its ValueError, or the OSError of a full disk
        (which has its own line), is raised on each, so none waits out the timeout for a failed write."""
        state = self.export_state(is_main)
        failure = None
        if is_main:
            try:
                self.write(state, target)
            except OSError as e:
                failure = e if e.errno == errno.ENOSPC else \
                    ValueError(f"writing the trained model to {target} failed: {e}")
            except ValueError as e:
                failure = e
        raise_on_every_rank(failure, group)

    def write(self, state: dict[str, Tensor], target: Path) -> None:
        """Write ``state`` (``export_state``'s) with the tokenizer as a transformers model folder at
        ``target``, unless a tensor holds NaN or Inf (then nothing is written). It is built in a hidden
        folder beside ``target`` and swapped in whole (``swap_in``); never through a link."""
        if target.is_symlink():
            raise ValueError(f"{target} is a symbolic link: dist-moe writes the trained model into a real folder")
        key = next((k for k, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())),
                   None)
        if key is not None:
            kept = "the previous one is kept" if target.exists() else "nothing was written"
            raise ValueError(f"not writing the trained model to {target}: {key!r} holds NaN or Inf ({kept}); the "
                             "model folder's weights or config.json, or a diverged run, put it there")
        settle_export(target)  # what a killed export left
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            with os_errors_of_safetensors(target), transformers_quiet(progress=False):
                self.hf.save_pretrained(tmp, state_dict={k: v.contiguous() for k, v in state.items()},
                                        safe_serialization=True)
                if self.tokenizer is not None:
                    self.tokenizer.save_pretrained(tmp)
            swap_in(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
