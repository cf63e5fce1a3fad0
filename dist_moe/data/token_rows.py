"""Next-token rows read where they lie: a [N, seq_len + 1] token array (text's tokens, in memory) or a token
file's sequences (``TokenFile``: read from the file a row at a time), and the rows of it a split takes,
turned into int64 tensors one batch at a time. A token file of many GB trains without a copy of it in
memory or on disk."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

SCAN_IDS = 1 << 22  # ids per read when a whole token file is scanned


class TokenFile:
    """The first ``rows * width`` ids of a flat token file (``offset`` bytes in) as [rows, width] sequences.
    Rows are read with ``pread`` when asked for: nothing of the file is mapped into this process (a memory
    map's pages, touched at random, would stay resident in it up to the file's size)."""

    def __init__(self, path: Path, dtype: np.dtype, offset: int, rows: int, width: int):
        self.path, self.dtype, self.offset = Path(path), np.dtype(dtype), offset
        self.shape = (rows, width)

    def __len__(self) -> int:
        return self.shape[0]

    def take(self, rows: np.ndarray, axis: int = 0) -> np.ndarray:
        """These rows, in this order (``numpy.take``'s form)."""
        width = self.shape[1]
        size = width * self.dtype.itemsize
        out = np.empty((len(rows), width), self.dtype)
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for i, row in enumerate(rows.tolist()):
                got = os.preadv(fd, [memoryview(out[i]).cast("B")], self.offset + row * size)
                if got != size:
                    raise ValueError(f"token file {self.path} changed while it was read (row {row} is cut short)")
        finally:
            os.close(fd)
        return out

    def id_range(self) -> tuple[int, int]:
        """(smallest, largest) id of the sequences, read a piece at a time; (0, 0) when empty."""
        low, high, left = 0, 0, self.shape[0] * self.shape[1]
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            first = True
            while left:
                piece = np.fromfile(f, self.dtype, min(left, SCAN_IDS))
                if not piece.size:
                    raise ValueError(f"token file {self.path} changed while it was read (it is shorter)")
                low = int(piece.min()) if first else min(low, int(piece.min()))
                high = int(piece.max()) if first else max(high, int(piece.max()))
                first, left = False, left - piece.size
        return low, high


class TokenRows:
    """``rows[i]`` of ``tokens`` (an array or a ``TokenFile``) as inputs (``part="x"``: all but the last token)
    or next-token targets (``"y"``: all but the first). Indexed like a tensor's first dimension (an int, a
    slice, an index tensor), it returns an int64 tensor; ``[rows, columns]`` indexes the columns of those rows."""

    def __init__(self, tokens: np.ndarray | TokenFile, rows: torch.Tensor, part: str):
        if part not in ("x", "y"):
            raise ValueError(f"part must be 'x' or 'y', got {part!r}")
        self.tokens, self.rows, self.part = tokens, rows, part

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.rows), self.tokens.shape[1] - 1

    def __getitem__(self, index) -> torch.Tensor:
        columns: tuple = ()
        if isinstance(index, tuple):
            index, columns = index[0], index[1:]
        picked = self.rows[index]
        block = self.tokens.take(np.atleast_1d(picked.numpy()), axis=0)  # these rows alone
        block = block[:, :-1] if self.part == "x" else block[:, 1:]
        out = torch.from_numpy(block.astype(np.int64))[(slice(None), *columns)]
        return out if picked.dim() else out[0]


def token_rows(tokens: np.ndarray | TokenFile, rows: torch.Tensor) -> tuple[TokenRows, TokenRows]:
    """(inputs, targets) of ``rows`` of ``tokens``."""
    return TokenRows(tokens, rows, "x"), TokenRows(tokens, rows, "y")
