"""``data=token_file``: token ids in a flat binary file on disk (nanoGPT's ``train.bin``
/ ``val.bin``: uint16 or uint32, native byte order), read window by window, never whole.
The template's docs/data.md.

A sample is ``seq_len + 1`` consecutive tokens: inputs the first ``seq_len``, targets
the same shifted by one. ``windows=sequential``: the file cut into non-overlapping
windows. ``windows=random``: ``samples_per_epoch`` windows at offsets drawn from
(seed, index), so a sample is the same on every rank, worker and resume. The
training loader shuffles their order per epoch (``make_loaders``).
``windows=stream``: ``TokenStream``, an IterableDataset reading the file in order
(no length: set trainer.max_steps), the template's example of a stream.

``write_tokens`` writes such a file and its sidecar JSON (vocabulary size, dtype),
which the YAML reads with ``${sidecar:...}``.
"""

import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from .config import require
from .loaders import LOADER_KEYS, DataLoaders, make_loaders

DTYPES = ("uint16", "uint32")
WINDOWS = ("random", "sequential", "stream")


class TokenWindows(Dataset):
    """Windows of a token file, each read from disk when asked for (the file is
    opened lazily in each process: loader workers get their own descriptor)."""

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
        self._fd: int | None = None  # opened in each process that reads

    def __len__(self) -> int:
        return self.count

    def offset(self, index: int) -> int:
        if self.windows == "sequential":
            return index * self.seq_len
        # A function of (seed, index) only: the same window wherever it is read.
        return int(np.random.default_rng((self.seed, index)).integers(self.span))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.window(self.offset(index))

    def window(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the ``seq_len + 1`` tokens from ``start``: one pread.
        Not a memory map: a mapped file's pages count as this process's resident
        memory (the kernel maps neighbouring cached pages too), a read's do not."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        itemsize = np.dtype(self.dtype).itemsize
        raw = os.pread(self._fd, (self.seq_len + 1) * itemsize, start * itemsize)
        window = torch.from_numpy(np.frombuffer(raw, dtype=self.dtype).astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fd": None}


class TokenStream(IterableDataset):
    """Non-overlapping windows in file order, as a stream: what a dataset too large to
    index (shards of files, a database cursor) looks like to the loop. Each epoch
    starts at an offset drawn from (seed, epoch) below ``seq_len``.

    The stream protocol the loop uses (duck-typed, loaders.continue_epoch):
    ``set_epoch(epoch)`` (accelerate calls it) and ``skip_to(epoch, samples)``: in
    that epoch, continue after ``samples`` samples of the whole run's stream (a
    resume). Processes share the stream through accelerate (the main process reads,
    every process gets its slice of each global batch); loader workers share it here,
    batch by batch in turn, so the order is the same with any ``num_workers``."""

    # Its samples follow from their position and (seed, epoch) alone: nothing for the
    # engine's per-sample seeding to make exact, and no warning (per_sample.py).
    draws_at_random = False

    def __init__(self, path: str, seq_len: int, dtype: str, seed: int, batch_size: int) -> None:
        self.windows = TokenWindows(path, seq_len, dtype, "sequential", None, seed)
        self.seed, self.batch_size = seed, batch_size
        self.epoch, self.resume = 0, (0, 0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip_to(self, epoch: int, samples: int) -> None:
        self.resume = (epoch, samples)

    def __iter__(self):
        windows, size = self.windows, self.batch_size
        start = self.resume[1] if self.resume[0] == self.epoch else 0
        shift = int(np.random.default_rng((self.seed, self.epoch)).integers(windows.seq_len))
        count = (windows.span - shift - 1) // windows.seq_len + 1
        worker = get_worker_info()
        workers, me = (worker.num_workers, worker.id) if worker else (1, 0)
        first = start // size
        for b in range(first, (count + size - 1) // size):
            if (b - first) % workers != me:
                continue  # another worker's batch (the loader takes them in turn from 0)
            for index in range(max(start, b * size), min(count, (b + 1) * size)):
                yield windows.window(shift + index * windows.seq_len)


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
        head = np.fromfile(path, dtype=dtype, count=1 << 20)  # the first 1M tokens
        largest = int(head.max()) if len(head) else 0
        require(
            "data.vocab_size",
            vocab_size,
            largest < vocab_size,
            f"more than the token id {largest} found in {path}",
        )
    if windows == "stream":
        train = TokenStream(train_path, seq_len, dtype, seed, batch_size)
    else:
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


token_file.resume_may_change = LOADER_KEYS


def write_tokens(path: str | Path, tokens: np.ndarray, vocab_size: int) -> Path:
    """Write ``tokens`` as ``path`` (uint16 when ``vocab_size`` fits, else uint32)
    and ``path`` with ``.json`` (``vocab_size``, ``dtype``, ``num_tokens``)."""
    path = Path(path)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    np.asarray(tokens, dtype=dtype).tofile(path)
    meta = {"vocab_size": int(vocab_size), "dtype": dtype, "num_tokens": len(tokens)}
    path.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    return path


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
