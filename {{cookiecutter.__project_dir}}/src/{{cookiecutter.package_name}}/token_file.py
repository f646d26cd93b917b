"""``data=token_file``: token ids in a flat binary file on disk (nanoGPT's ``train.bin``
/ ``val.bin``: uint16 or uint32, native byte order), memory-mapped, never read whole.
README: "Your own data".

A sample is ``seq_len + 1`` consecutive tokens: inputs the first ``seq_len``, targets
the same shifted by one. ``windows=sequential``: the file cut into non-overlapping
windows. ``windows=random``: ``samples_per_epoch`` windows at offsets drawn from
(seed, index), so a sample is the same on every rank, worker and resume. The
training loader shuffles their order per epoch (``make_loaders``).

``write_tokens`` writes such a file and its sidecar JSON (vocabulary size, dtype),
which the YAML reads with ``${sidecar:...}``.
"""

import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .config import require
from .loaders import DataLoaders, make_loaders

DTYPES = ("uint16", "uint32")
WINDOWS = ("random", "sequential")


class TokenWindows(Dataset):
    """Windows of a memory-mapped token file. The map is opened lazily in each
    process (a pickled memmap would copy the file into every worker)."""

    def __init__(
        self, path: str, seq_len: int, dtype: str, windows: str, count: int | None, seed: int
    ) -> None:
        self.path, self.seq_len, self.dtype, self.windows, self.seed = (
            path,
            seq_len,
            dtype,
            windows,
            seed,
        )
        self.num_tokens = Path(path).stat().st_size // np.dtype(dtype).itemsize
        span = self.num_tokens - seq_len  # window starts that leave room for the target
        require(
            "data.seq_len",
            seq_len,
            span >= 1,
            f"less than the {self.num_tokens} tokens in {path}",
        )
        self.span = span
        whole = (span - 1) // seq_len + 1  # non-overlapping windows in the file
        self.count = whole if count is None else count
        if windows == "sequential":
            self.count = min(self.count, whole)
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        return self.count

    def offset(self, index: int) -> int:
        if self.windows == "sequential":
            return index * self.seq_len
        # A function of (seed, index) only: the same window wherever it is read.
        return int(np.random.default_rng((self.seed, index)).integers(self.span))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = self.offset(index)
        window = torch.from_numpy(
            self._tokens[start : start + self.seq_len + 1].astype(np.int64)
        )
        return window[:-1], window[1:]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}


def token_file(
    batch_size: int,
    seed: int,
    train_path: str,
    val_path: str,
    vocab_size: int,
    seq_len: int = 128,
    dtype: str = "uint16",
    windows: str = "random",
    samples_per_epoch: int | None = None,
    val_batch_size: int = 64,
    num_workers: int = 0,
    pin_memory: bool | None = None,
) -> DataLoaders:
    """Training windows from ``train_path`` (``windows``; ``samples_per_epoch``, default
    one window per ``seq_len`` tokens), validation from ``val_path`` (always
    sequential, so scores compare across seeds). ``vocab_size`` is checked on a
    sample of tokens, not the whole file."""
    require("data.dtype", dtype, dtype in DTYPES, f"one of {', '.join(DTYPES)}")
    require("data.windows", windows, windows in WINDOWS, f"one of {', '.join(WINDOWS)}")
    require("data.seq_len", seq_len, _is_int(seq_len) and seq_len >= 1, "an integer >= 1")
    require(
        "data.vocab_size", vocab_size, _is_int(vocab_size) and vocab_size >= 2, "an integer >= 2"
    )
    require(
        "data.samples_per_epoch",
        samples_per_epoch,
        samples_per_epoch is None or (_is_int(samples_per_epoch) and samples_per_epoch >= 1),
        "null or an integer >= 1",
    )
    for key, path in [("train_path", train_path), ("val_path", val_path)]:
        size = Path(path).stat().st_size
        itemsize = np.dtype(dtype).itemsize
        require(f"data.{key}", path, size % itemsize == 0, f"a whole number of {dtype} values")
        head = np.memmap(path, dtype=dtype, mode="r")[: 1 << 20]  # the first 1M tokens
        largest = int(head.max()) if len(head) else 0
        require(
            "data.vocab_size",
            vocab_size,
            largest < vocab_size,
            f"more than the token id {largest} found in {path}",
        )
    train = TokenWindows(train_path, seq_len, dtype, windows, samples_per_epoch, seed)
    val = TokenWindows(val_path, seq_len, dtype, "sequential", None, seed)
    return make_loaders(
        train,
        val,
        batch_size=batch_size,
        val_batch_size=val_batch_size,
        seed=seed,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


token_file.resume_may_change = ("num_workers", "pin_memory", "val_batch_size")


def write_tokens(path: str | Path, tokens: np.ndarray, vocab_size: int) -> Path:
    """Write ``tokens`` as ``path`` (uint16 when ``vocab_size`` fits, else uint32)
    and ``path`` with ``.json`` (``vocab_size``, ``dtype``, ``num_tokens``)."""
    path = Path(path)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    np.asarray(tokens, dtype=dtype).tofile(path)
    meta = {"vocab_size": int(vocab_size), "dtype": dtype, "num_tokens": int(len(tokens))}
    path.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    return path


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
