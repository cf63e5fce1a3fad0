"""A multi-domain byte-level text corpus from installed packages (no download at run time).

Domains (the SpecDrop category of each sequence):

fortunes    Debian fortunes-min: /usr/share/games/fortunes/fortunes (quotes, split on "%")
literature  Debian fortunes-min: /usr/share/games/fortunes/literature
glosses     Debian wordnet-base: /usr/share/wordnet/data.{noun,verb,adj,adv}, the gloss after "|"
code        Python's own standard library sources (*.py), always present

Documents of each domain are joined with newlines and cut into sequences of
``seq_len + 1`` bytes (inputs and next-byte targets); every domain contributes
the same number of sequences (the smallest domain's count, capped by
``per_domain``), drawn with a fixed seed. Cached under the data directory as
``corpus_<seq_len>_<per_domain>_<seed>.npz``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dist_moe.data.paths import data_dir, load_cache, save_cache
from dist_moe.data.sources import fortune_quotes, stdlib_code, wordnet_synsets
from dist_moe.data.token_rows import TokenRows

DOMAINS = ("fortunes", "literature", "glosses", "code")


def domain_text(name: str) -> str:
    if name in ("fortunes", "literature"):
        return "\n".join(fortune_quotes(name))
    if name == "glosses":
        return "\n".join(gloss for part in ("noun", "verb", "adj", "adv") for gloss, _ in wordnet_synsets(part))
    if name == "code":
        return stdlib_code()
    raise ValueError(f"domain must be one of {DOMAINS}, got {name!r}")


@dataclass
class Corpus:
    tokens: torch.Tensor  # [N, seq_len + 1] uint8 bytes
    domain: torch.Tensor  # [N] int64, index into DOMAINS

    def split(self, val_fraction: float, seed: int):
        train, val = split_rows(len(self.tokens), val_fraction, seed)
        return Corpus(self.tokens[train], self.domain[train]), Corpus(self.tokens[val], self.domain[val])


def split_rows(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, validation rows) of ``n`` sequences, drawn with ``seed``: the validation rows first
    in one permutation, so a prefix of them is a sample of the split."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(round(n * val_fraction)))
    return perm[n_val:], perm[:n_val]


def cache_path(seq_len: int, per_domain: int, seed: int) -> Path:
    """Where ``load_corpus`` keeps (and first looks for) the corpus of these settings."""
    return data_dir() / f"corpus_{seq_len}_{per_domain}_{seed}.npz"


def load_corpus(seq_len: int = 64, per_domain: int = 2000, seed: int = 0) -> Corpus:
    if seq_len < 2 or per_domain < 1:
        raise ValueError(f"seq_len must be >= 2 and per_domain >= 1, got {seq_len}, {per_domain}")
    cache = cache_path(seq_len, per_domain, seed)
    cached = load_cache(cache, {"tokens": ("u", 2), "domain": ("iu", 1)}, same_rows=("tokens", "domain"))
    if cached is not None:
        tokens, domain = cached["tokens"], cached["domain"]
        if tokens.dtype != np.uint8 or tokens.shape[1] != seq_len + 1 or not np.isin(domain, range(len(DOMAINS))).all():
            raise ValueError(f"data cache {cache} does not hold uint8 sequences of {seq_len + 1} bytes with "
                             f"domains 0-{len(DOMAINS) - 1}: delete it and the next run rebuilds it")
        return Corpus(torch.from_numpy(tokens), torch.from_numpy(domain.astype(np.int64)))
    chunks = []
    for name, text in ((d, domain_text(d)) for d in DOMAINS):
        data = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
        n = len(data) // (seq_len + 1)
        if n < 3:  # every domain gives as many as the smallest: 3 x 4 sequences, at least tabular.MIN_ROWS
            raise ValueError(f"data.seq_len={seq_len} cuts domain {name!r} ({len(data)} bytes) into fewer than 3 "
                             f"sequences of {seq_len + 1} bytes: set it to at most {len(data) // 3 - 1}")
        chunks.append(data[: n * (seq_len + 1)].reshape(n, seq_len + 1))
    take = min(per_domain, min(len(c) for c in chunks))
    rng = np.random.default_rng(seed)
    tokens = np.concatenate([c[np.sort(rng.choice(len(c), take, replace=False))] for c in chunks])
    domain = np.repeat(np.arange(len(DOMAINS)), take)
    save_cache(cache, tokens=tokens, domain=domain)
    return Corpus(torch.from_numpy(tokens), torch.from_numpy(domain))


@dataclass
class LMSplit:
    """The corpus in the trainer's split interface: inputs are bytes, targets the next bytes,
    and each sequence's domain is its category (``data.categories: domains``). A local source's rows are
    ``TokenRows``, read a batch at a time; the corpus's are tensors."""

    x_train: torch.Tensor | TokenRows
    y_train: torch.Tensor | TokenRows
    d_train: torch.Tensor
    x_val: torch.Tensor | TokenRows
    y_val: torch.Tensor | TokenRows
    d_val: torch.Tensor
    with_categories: bool
    num_classes: int = 256
    class_category: torch.Tensor | None = None
    classes: tuple = ()

    @property
    def category_names(self):
        return list(DOMAINS) if self.with_categories else None

    def train_categories(self, rows):
        return self.d_train[rows] if self.with_categories else None

    def val_categories(self, rows=slice(None)):
        return self.d_val[rows] if self.with_categories else None


def lm_split(seq_len: int, per_domain: int, val_fraction: float, seed: int, categories: str | None) -> LMSplit:
    if categories not in (None, "domains"):
        raise ValueError(f"data.categories for the corpus must be 'domains' or null, got {categories!r}")
    return next_token_split(load_corpus(seq_len, per_domain, seed), val_fraction, seed, categories == "domains")


def next_token_split(corpus: Corpus, val_fraction: float, seed: int, with_categories: bool,
                     num_classes: int = 256) -> LMSplit:
    """``corpus``'s sequences split with ``seed``, each as inputs and next-token targets."""
    train, val = corpus.split(val_fraction, seed)
    tr, va = train.tokens.long(), val.tokens.long()
    return LMSplit(tr[:, :-1], tr[:, 1:], train.domain, va[:, :-1], va[:, 1:], val.domain, with_categories,
                   num_classes)
