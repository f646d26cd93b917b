"""Documents packed into rows of ``seq_len`` positions that do not attend across them
(data=chat, and data=text with ``packing: documents``; docs/finetune.md).

A document of ``n`` tokens gives ``n - 1`` positions: its inputs (all tokens but the
last), its next-token targets (all but the first; -100 where the loss must not learn
them: a prompt's tokens, padding) and its position ids, which restart at 0. A row is
``(inputs, targets, positions)``, each ``seq_len`` long, holding whole documents one
after another and padding at the end (its own "document": padding attends to itself).

Models read the documents from the position ids, where they do not go up by one:
transformers builds its block-diagonal causal mask from them
(``masking_utils.find_packed_sequence_indices``, when called without a cache: the task
passes ``use_cache=False``), flash-attention its variable-length kernel; model=gpt
does the same (models/gpt.py). So a token sees its own document only, at the positions
it would have alone.

Rows are filled best-fit decreasing: each document, longest first, goes into the row
whose free space fits it most tightly (few padded positions; ``source.json`` reports the
share). Hand-written: TRL's ``pack_dataset`` does the same on Arrow tables, and TRL is
not worth a dependency for these 30 lines.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

IGNORE = -100  # a target the loss ignores (torch's cross_entropy ignore_index)


def pieces(ids: np.ndarray, mask: np.ndarray, limit: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A document longer than ``limit`` tokens cut into pieces of at most ``limit``,
    each starting on the previous one's last token: every token but the first is a
    target exactly once (a piece restarts its positions at 0)."""
    if len(ids) <= limit:
        return [(ids, mask)]
    step = limit - 1
    return [(ids[i : i + limit], mask[i : i + limit]) for i in range(0, len(ids) - 1, step)]


def pack(
    documents: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int
) -> tuple[np.ndarray, dict[str, Any]]:
    """``documents`` (token ids and a 0/1 target mask per token, each at most
    ``seq_len + 1`` tokens) as rows ``(n, 3, seq_len)`` of int32: inputs, targets,
    positions; and what the packing did (rows, documents, the padded share)."""
    sizes = [len(ids) - 1 for ids, _ in documents]
    order = sorted((i for i, n in enumerate(sizes) if n >= 1), key=lambda i: -sizes[i])
    rows: list[list[int]] = []  # the documents of each row, in placement order
    free: dict[int, list[int]] = {}  # free space -> rows with that much
    spaces: list[int] = []  # the distinct free spaces some row has, ascending
    for i in order:
        size = sizes[i]
        at = bisect.bisect_left(spaces, size)
        if at < len(spaces):  # the tightest row it fits in
            space = spaces[at]
            row = free[space].pop()
            if not free[space]:
                del free[space], spaces[at]
        else:
            space, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(i)
        left = space - size
        if left:
            if left not in free:
                free[left] = []
                bisect.insort(spaces, left)
            free[left].append(row)
    out = np.zeros((len(rows), 3, seq_len), dtype=np.int32)
    for r, members in enumerate(rows):
        start = 0
        for i in members:
            ids, mask = documents[i]
            n = sizes[i]
            out[r, 0, start : start + n] = ids[:-1]
            out[r, 1, start : start + n] = np.where(mask[1:] > 0, ids[1:], IGNORE)
            out[r, 2, start : start + n] = np.arange(n)
            start += n
        out[r, 0, start:] = pad_id
        out[r, 1, start:] = IGNORE
        out[r, 2, start:] = np.arange(seq_len - start)
    used = sum(sizes[i] for i in order)
    report = {
        "rows": len(rows),
        "documents": len(order),
        "positions": len(rows) * seq_len,
        "padding": round(1 - used / max(1, len(rows) * seq_len), 4),
        "targets": int((out[:, 1] != IGNORE).sum()),  # what the loss counts
    }
    return out, report


class PackedRows(Dataset):
    """The rows of ``pack`` in a ``.npy`` file, read row by row (memory-mapped):
    ``(inputs, targets, positions)`` as int64 tensors."""

    # A row follows from its index alone: nothing random to make exact (per_sample.py).
    draws_at_random = False

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.rows = np.load(self.path, mmap_mode="r")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        row = torch.from_numpy(np.asarray(self.rows[index], dtype=np.int64))
        return row[0], row[1], row[2]

    def __getstate__(self) -> dict:  # workers map the file themselves
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])
