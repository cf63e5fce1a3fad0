"""A user's transformers causal-LM MoE model for ``dist-moe train`` (``model.kind: hf``).

``model.path`` is a local transformers model folder (or its ``config.json``): with ``*.safetensors``
weights it loads them (never pickled ``.bin`` weights, and never the folder's own code), else it
starts from random weights drawn with the run's seed (the same on every rank). Its MoE blocks' experts
are sharded over the launched world and dispatched by dist-moe (``integrations/transformers_hosted``);
everything else is the model's own and replicated. ``HFCausalLM`` gives the trainer its usual
``(logits, aux) = model(tokens, categories)``; ``export`` writes the trained model where
``AutoModelForCausalLM.from_pretrained`` reads it, tokenizer included.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import Tensor, nn

from dist_moe.integrations.transformers_hosted import HostedHFExperts, moe_blocks

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


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
    """Whether the folder holds safetensors weights; pickled .bin weights alone are refused."""
    if any(folder.glob("*.safetensors")):
        return True
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise ValueError(f"model.path={str(folder)!r} holds only pickled (.bin / .pt) weights, which can run code when "
                         "loaded: save them as safetensors (model.save_pretrained(folder)) first")
    return False


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_config(folder: Path):
    """The folder's transformers config, checked to be a causal LM transformers knows without the folder's code."""
    # transformers: an optional engine, imported only where it is used
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"model.path={str(folder)!r}: transformers cannot read its config.json ({first})") from None


def load_model(folder: Path, seed: int) -> nn.Module:
    """The folder's causal LM in fp32, its weights or (none saved) random ones drawn from ``seed``."""
    from transformers import AutoModelForCausalLM

    config = load_config(folder)
    try:
        if has_weights(folder):
            model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, trust_remote_code=False,
                                                         use_safetensors=True, dtype=torch.float32)
        else:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"model.path={str(folder)!r}: transformers cannot build a causal LM from it "
                         f"({first})") from None
    if not moe_blocks(model):
        raise ValueError(f"model.path={str(folder)!r} is a {type(model).__name__} without MoE blocks dist-moe can host "
                         "(a router `gate` beside stacked `experts` weights, as Mixtral, Qwen3-MoE, DeepSeek-V3 have)")
    return model.train()


def parameter_count(folder: Path) -> tuple[int, int]:
    """(dense parameters, expert parameters) of the folder's model, counted without allocating it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(folder), trust_remote_code=False)
    experts = sum(p.numel() for block, _ in moe_blocks(model) for p in block.experts.parameters())
    return sum(p.numel() for p in model.parameters()) - experts, experts


class HFCausalLM(nn.Module):
    """``(logits [B, S, V], aux) = model(tokens [B, S], categories=None)`` for the trainer; ``aux`` is the
    model's own router loss times its ``router_aux_loss_coef`` when its config asks for it
    (``output_router_logits``), else 0."""

    def __init__(self, hf: nn.Module, folder: Path):
        super().__init__()
        self.hf = hf
        self.folder = folder
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

    def export(self, target: Path, is_main: bool) -> None:
        """Write the model as transformers saves it (every rank calls this: the experts are gathered), with
        the model folder's tokenizer, to ``target``, replacing what was there only once the new one is whole."""
        state = self.hf.state_dict()
        for name, m in self.hf.named_modules():
            if isinstance(m, HostedHFExperts):
                state.update({f"{name}.{slot}": t for slot, t in m.full_expert_tensors().items()})
        if not is_main:
            return
        if target.is_symlink():
            raise ValueError(f"{target} is a symbolic link: dist-moe writes the trained model into a real folder")
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.hf.save_pretrained(tmp, state_dict={k: v.detach().cpu().contiguous() for k, v in state.items()},
                                safe_serialization=True)
        if has_tokenizer(self.folder):
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(self.folder, local_files_only=True).save_pretrained(tmp)
        old = target.with_name(f".{target.name}.{os.getpid()}.old")
        if target.exists():
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
