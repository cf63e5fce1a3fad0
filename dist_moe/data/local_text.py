"""A user's own text for the LM: ``data.name`` a local text file, a folder of text files, or a
pre-tokenized token file (``.npy``: a 1-D integer array; ``.bin``: a flat array of ``data.token_dtype``,
nanoGPT's uint16 layout or Megatron's uint32).

A token file is read where it lies, the rows of a batch when the batch is taken: no copy in memory or on
disk, so its size is bounded by the disk, not the memory. Text is read as UTF-8 bytes (the byte LM's
vocabulary), or tokenized by a transformers model folder's tokenizer (``model.kind: hf``; files joined by
its end-of-text token); a folder's regular files, in sorted path order, joined with newlines: hidden files,
links and the data directory's own caches left out. Text is read into memory, after a check that it fits,
and its tokens are cached under the data directory, keyed by the source's path, size and modification
time, so a changed file is read again (a rewrite that keeps both, as ``cp -p`` can, is not noticed: delete
the ``local_*.npz`` cache then). The stream is cut into sequences of ``seq_len + 1`` tokens (inputs and
next-token targets), split into training and validation rows with the run's seed, and read a batch at a
time (``token_rows.TokenRows``). Everything is checked at load, naming what is wrong in one line.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from dist_moe.data.corpus import LMSplit, split_rows
from dist_moe.data.paths import data_dir, load_cache, save_cache
from dist_moe.data.token_rows import TokenFile, token_rows
from dist_moe.models.hf_model import load_tokenizer, token_ids

TOKEN_FILES = (".npy", ".bin")
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
MIN_SEQUENCES = 3  # a validation row and training rows, as the built-in corpus needs
# peak bytes of memory per byte of text while it is read: the bytes, their uint16 stream, its sequences;
# through a tokenizer also the text as a str, the id lists of a piece and the uint32 ids
READ_COST = {"bytes": 5, "tokenizer": 12}
ROW_BYTES = 16  # per sequence, whatever the source: its place in the split's two row orders


def is_local(name: str) -> bool:
    """Whether ``data.name`` names a local source rather than a built-in data set."""
    return "/" in name or name.endswith((".txt", *TOKEN_FILES)) or Path(name).exists()


def check_uncategorized(name: str, categories: str | None) -> None:
    """A local source has no categories to give SpecDrop (``data.categories`` must be null)."""
    if categories is not None:
        raise ValueError(f"data.categories must be null for a local source (data.name={name!r}), got {categories!r}")


def local_split(name: str, seq_len: int, val_fraction: float, seed: int, vocab: int = 256,
                token_dtype: str = "uint16", tokenizer: Path | None = None, memory: int | None = None) -> LMSplit:
    """Training and validation sequences of ``name``; text as bytes, or through ``tokenizer`` (a
    transformers model folder holding one). ``memory``: the bytes this process may use to read the source
    (None: no check)."""
    tokens = load_sequences(Path(name), seq_len, token_dtype, tokenizer, memory)
    top = tokens.id_range()[1] if isinstance(tokens, TokenFile) else int(tokens.max())
    if top >= vocab:
        raise ValueError(f"data.name={name!r} holds token id {top}; the model reads ids below {vocab} "
                         f"({'its tokenizer' if tokenizer is not None else 'text as bytes'})")
    train, val = split_rows(len(tokens), val_fraction, seed)
    none = torch.zeros(0, dtype=torch.long)  # no categories: LMSplit never reads them
    return LMSplit(*token_rows(tokens, train), none, *token_rows(tokens, val), none, False, vocab)


def load_sequences(path: Path, seq_len: int, token_dtype: str = "uint16", tokenizer: Path | None = None,
                   memory: int | None = None) -> np.ndarray | TokenFile:
    """[N, seq_len + 1] tokens of ``path``: a token file's sequences where they lie, or text's tokens (from the
    cache when it holds this source as it is now)."""
    if not path.exists():
        raise ValueError(f"data.name={str(path)!r}: no such file or folder")
    files = _files(path)
    if path.suffix in TOKEN_FILES:  # tokenized already: read in place, never copied
        dtype, offset, count = _token_layout(path, token_dtype)
        rows = _sequence_count(count, seq_len, path)
        _check_memory(path, ROW_BYTES * rows, memory, "index its sequences")
        tokens = TokenFile(path, dtype, offset, rows, seq_len + 1)
        low, high = tokens.id_range()
        if low < 0:
            raise ValueError(f"data.name={str(path)!r} holds negative token ids")
        if high >= 1 << 32:
            raise ValueError(f"data.name={str(path)!r} holds token id {high}, beyond any vocabulary")
        return tokens
    key = _key(path, files + (_tokenizer_files(tokenizer) if tokenizer else []), seq_len, token_dtype)
    cache = data_dir() / f"local_{key}.npz"
    if cache.is_file():
        _check_memory(path, cache.stat().st_size, memory, f"load its cache {cache}")
    cached = load_cache(cache, {"tokens": ("u", 2)})
    if cached is not None:
        tokens = cached["tokens"]
        if tokens.shape[1] != seq_len + 1:
            raise ValueError(f"data cache {cache} does not hold sequences of {seq_len + 1} tokens: delete it and the "
                             "next run rebuilds it")
        return tokens
    size = sum(f.stat().st_size for f in files)
    _check_memory(path, READ_COST["tokenizer" if tokenizer else "bytes"] * size, memory,
                  f"read its {size / 2**30:.3g} GiB of text")
    stream = _text(files) if tokenizer is None else _tokenized(files, tokenizer)
    tokens = np.ascontiguousarray(_sequences(stream, seq_len, path))
    save_cache(cache, tokens=tokens)
    return tokens


def _check_memory(path: Path, needed: int, memory: int | None, what: str) -> None:
    if memory is not None and needed > memory:
        raise ValueError(f"data.name={str(path)!r}: to {what} this process needs about {needed / 2**30:.3g} GiB, "
                         f"more than the {memory / 2**30:.3g} GiB of memory available to it; give the text as a "
                         ".npy or .bin token file, which is read in place, or use fewer ranks on this machine")


def _sequences(stream: np.ndarray, seq_len: int, path: Path) -> np.ndarray:
    """``stream`` cut into [N, seq_len + 1]."""
    n = _sequence_count(len(stream), seq_len, path)
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def _sequence_count(tokens: int, seq_len: int, path: Path) -> int:
    n = tokens // (seq_len + 1)
    if n < MIN_SEQUENCES:
        raise ValueError(f"data.name={str(path)!r} holds {tokens} tokens: fewer than {MIN_SEQUENCES} sequences "
                         f"of data.seq_len + 1 = {seq_len + 1} (lower data.seq_len or give more text)")
    return n


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


def _token_layout(path: Path, token_dtype: str) -> tuple[np.dtype, int, int]:
    """(id dtype, byte offset of the first id, id count) of a token file: a .bin is all ids, an .npy's
    header says (a 1-D integer array, read without pickle)."""
    if path.suffix == ".bin":
        dtype = np.dtype(TOKEN_DTYPES[token_dtype])
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise ValueError(f"data.name={str(path)!r} has {size} bytes, not a whole number of {token_dtype} tokens "
                             "(set data.token_dtype)")
        return dtype, 0, size // dtype.itemsize
    try:  # mapped to read its header's layout; no id is touched
        arr = np.load(path, allow_pickle=False, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise ValueError(f"data.name={str(path)!r} is not a readable .npy array: {e}") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive under an .npy name
        raise ValueError(f"data.name={str(path)!r} is not one .npy array (an .npz archive?)")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"data.name={str(path)!r} must hold a 1-D integer array of token ids, got "
                         f"{arr.ndim}-D {arr.dtype}")
    return arr.dtype, int(arr.offset) if isinstance(arr, np.memmap) else 0, arr.size



def _text(files: list[Path]) -> np.ndarray:
    """The files' bytes, joined by newlines, as one uint16 token stream."""
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
            ids = token_ids(tok, text[start:end], folder, f)
            parts.append(np.asarray(ids, dtype=np.uint32))
            start = end
        if tok.eos_token_id is not None:
            parts.append(np.asarray([tok.eos_token_id], dtype=np.uint32))
    stream = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
    return stream if stream.size and stream.max() >= 1 << 16 else stream.astype(np.uint16)
