"""A user's own text for the LM: ``data.name`` a local text file, a folder of text files, or a
pre-tokenized token file (``.npy``: a 1-D integer array; ``.bin``: a flat array of ``data.token_dtype``,
nanoGPT's uint16 layout or Megatron's uint32).

Text is read as UTF-8 bytes (the byte LM's vocabulary), or tokenized by a transformers model folder's
tokenizer (``model.kind: hf``; files joined by its end-of-text token); a folder's regular files, in sorted path
order, joined with newlines: hidden files, links and the data directory's own caches left out. The stream is cut into sequences of
``seq_len + 1`` tokens (inputs and next-token targets), split into training and validation rows
with the run's seed, and cached under the data directory, keyed by the source's path, size and
modification time, so a changed file is read again (a rewrite that keeps both, as ``cp -p`` can,
is not noticed: delete the ``local_*.npz`` cache then). Everything is checked at load, naming what
is wrong in one line.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from dist_moe.data.corpus import Corpus, LMSplit, next_token_split
from dist_moe.data.paths import data_dir, load_cache, save_cache
from dist_moe.models.hf_model import load_tokenizer

TOKEN_FILES = (".npy", ".bin")
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
MIN_SEQUENCES = 3  # a validation row and training rows, as the built-in corpus needs


def is_local(name: str) -> bool:
    """Whether ``data.name`` names a local source rather than a built-in data set."""
    return "/" in name or name.endswith((".txt", *TOKEN_FILES)) or Path(name).exists()


def local_split(name: str, seq_len: int, val_fraction: float, seed: int, categories: str | None,
                vocab: int = 256, token_dtype: str = "uint16", tokenizer: Path | None = None) -> LMSplit:
    """Training and validation sequences of ``name``; text as bytes, or through ``tokenizer`` (a
    transformers model folder holding one)."""
    if categories is not None:
        raise ValueError(f"data.categories must be null for a local source (data.name={name!r}), got {categories!r}")
    tokens = load_sequences(Path(name), seq_len, token_dtype, tokenizer)
    top = int(tokens.max())
    if top >= vocab:
        raise ValueError(f"data.name={name!r} holds token id {top}; the model reads ids below {vocab} "
                         f"({'its tokenizer' if tokenizer is not None else 'text as bytes'})")
    corpus = Corpus(torch.from_numpy(tokens.astype(np.int64)), torch.zeros(len(tokens), dtype=torch.long))
    return next_token_split(corpus, val_fraction, seed, with_categories=False, num_classes=vocab)


def load_sequences(path: Path, seq_len: int, token_dtype: str = "uint16", tokenizer: Path | None = None) -> np.ndarray:
    """[N, seq_len + 1] tokens of ``path``, from the cache when it holds this source as it is now."""
    if not path.exists():
        raise ValueError(f"data.name={str(path)!r}: no such file or folder")
    files = _files(path)
    tokenizer = None if path.suffix in TOKEN_FILES else tokenizer  # token files are tokenized already
    key = _key(path, files + (_tokenizer_files(tokenizer) if tokenizer else []), seq_len, token_dtype)
    cache = data_dir() / f"local_{key}.npz"
    cached = load_cache(cache, {"tokens": ("u", 2)})
    if cached is not None:
        tokens = cached["tokens"]
        if tokens.shape[1] != seq_len + 1:
            raise ValueError(f"data cache {cache} does not hold sequences of {seq_len + 1} tokens: delete it and the "
                             "next run rebuilds it")
        return tokens
    stream = _tokens(path, files, token_dtype) if tokenizer is None else _tokenized(files, tokenizer)
    n = len(stream) // (seq_len + 1)
    if n < MIN_SEQUENCES:
        raise ValueError(f"data.name={str(path)!r} holds {len(stream)} tokens: fewer than {MIN_SEQUENCES} sequences "
                         f"of data.seq_len + 1 = {seq_len + 1} (lower data.seq_len or give more text)")
    tokens = np.ascontiguousarray(stream[: n * (seq_len + 1)].reshape(n, seq_len + 1))
    save_cache(cache, tokens=tokens)
    return tokens


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"data.name={str(path)!r} is neither a file nor a folder")
    root, cache = path.resolve(), data_dir().resolve()
    files = sorted(p for p in path.rglob("*") if _readable_text(p, path, root, cache))
    if not files:
        raise ValueError(f"data.name={str(path)!r} is a folder without files")
    if any(p.suffix in TOKEN_FILES for p in files):
        raise ValueError(f"data.name={str(path)!r} mixes token files into a folder of text: give the token file itself")
    return files


def _readable_text(p: Path, folder: Path, root: Path, cache: Path) -> bool:
    """A folder's file to read: a regular file, not hidden, not a link (a folder from elsewhere must not
    pull in what its links point to), and not this project's data cache (a cache written into the
    folder would be read as text by the next run)."""
    if p.is_symlink() or not p.is_file() or any(part.startswith(".") for part in p.relative_to(folder).parts):
        return False
    real = p.resolve()
    return real.is_relative_to(root) and not real.is_relative_to(cache)


def _key(path: Path, files: list[Path], seq_len: int, token_dtype: str) -> str:
    """The cache's name: this source, as it is now (every file's path, size and modification time)."""
    h = hashlib.sha256(f"{path.resolve()}|{seq_len}|{token_dtype}".encode())
    for f in files:
        st = f.stat()
        h.update(f"|{f}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _tokens(path: Path, files: list[Path], token_dtype: str) -> np.ndarray:
    """The source as one flat token stream."""
    if path.is_file() and path.suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise ValueError(f"data.name={str(path)!r} is not a readable .npy array: {e}") from None
        if not isinstance(arr, np.ndarray):  # an .npz archive under an .npy name
            raise ValueError(f"data.name={str(path)!r} is not one .npy array (an .npz archive?)")
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"data.name={str(path)!r} must hold a 1-D integer array of token ids, got "
                             f"{arr.ndim}-D {arr.dtype}")
        if arr.size and int(arr.min()) < 0:
            raise ValueError(f"data.name={str(path)!r} holds negative token ids")
        if arr.size and int(arr.max()) >= 1 << 32:
            raise ValueError(f"data.name={str(path)!r} holds token id {int(arr.max())}, beyond any vocabulary")
        return np.asarray(arr, dtype=np.uint32 if arr.size and int(arr.max()) >= 1 << 16 else np.uint16)
    if path.is_file() and path.suffix == ".bin":
        dtype = TOKEN_DTYPES[token_dtype]
        size = path.stat().st_size
        if size % np.dtype(dtype).itemsize:
            raise ValueError(f"data.name={str(path)!r} has {size} bytes, not a whole number of {token_dtype} tokens "
                             "(set data.token_dtype)")
        return np.fromfile(path, dtype=dtype)
    data = b"\n".join(f.read_bytes() for f in files)
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def _tokenizer_files(folder: Path) -> list[Path]:
    """The model folder's files but its weights: a changed tokenizer tokenizes again, new weights do not."""
    return sorted(p for p in folder.iterdir() if p.is_file() and ".safetensors" not in p.name)


TOKENIZE_CHUNK = 1 << 20  # characters per tokenizer call, cut at a line end: a large file never is one string


def _tokenized(files: list[Path], folder: Path) -> np.ndarray:
    """The text files through the model folder's tokenizer, one after another, each ended by its
    end-of-text token when it has one; each file in pieces of about ``TOKENIZE_CHUNK`` characters, cut
    after a newline, gathered as uint32 arrays."""
    tok = load_tokenizer(folder)
    parts = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        start = 0
        while start < len(text):
            cut = text.find("\n", start + TOKENIZE_CHUNK)
            end = len(text) if cut < 0 else cut + 1
            ids = tok(text[start:end], add_special_tokens=False, verbose=False)["input_ids"]
            parts.append(np.asarray(ids, dtype=np.uint32))
            start = end
        if tok.eos_token_id is not None:
            parts.append(np.asarray([tok.eos_token_id], dtype=np.uint32))
    stream = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
    return stream if stream.size and stream.max() >= 1 << 16 else stream.astype(np.uint16)
