"""Synthetic token sequences for the GPT example (``data=tokens``): a walk through a
fixed random Markov "language", then the same walk repeated, generated in memory from
``data_seed`` (no download). docs/data.md.
"""

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ..contract import LOADER_KEYS, DataLoaders, make_loaders, require


def markov_language(vocab_size: int, branching: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed random "language": each token has ``branching`` possible next
    tokens with random probabilities. Returns (successors, cumulative probabilities)."""
    rng = np.random.default_rng(seed)
    successors = np.stack(
        [rng.choice(vocab_size, branching, replace=False) for _ in range(vocab_size)]
    )
    probs = rng.dirichlet(np.ones(branching), size=vocab_size)
    return successors, np.cumsum(probs, axis=1)


def copy_task_sequences(
    count: int, length: int, language: tuple[np.ndarray, np.ndarray], seed: int
) -> torch.Tensor:
    """``count`` sequences of ``length`` tokens (int64): a walk through the
    language, then that walk repeated. Both halves are learnable: the first from
    the transition statistics (loss falls toward their entropy), the repeat only
    by attending back to the first half (loss falls toward 0)."""
    successors, cumulative = language
    rng = np.random.default_rng(seed)
    half = (length + 1) // 2
    walk = np.empty((count, half), dtype=np.int64)
    walk[:, 0] = rng.integers(len(successors), size=count)
    for t in range(1, half):
        pick = (rng.random((count, 1)) > cumulative[walk[:, t - 1]]).sum(axis=1)
        walk[:, t] = successors[walk[:, t - 1], np.minimum(pick, successors.shape[1] - 1)]
    return torch.from_numpy(np.concatenate([walk, walk], axis=1)[:, :length])


def tokens(
    batch_size: int,
    seed: int,
    seq_len: int = 128,
    vocab_size: int = 256,
    branching: int = 4,
    num_train: int = 8192,
    num_val: int = 512,
    data_seed: int = 0,
    val_batch_size: int = 64,
    num_workers: int = 0,
    pin_memory: bool | None = None,
) -> DataLoaders:
    """Next-token prediction on synthetic sequences, generated in memory from
    ``data_seed`` (numpy's PCG64: the same tokens on every machine, no download).
    Inputs are ``seq_len`` tokens, targets the same sequence shifted by one."""
    for key, value in [("seq_len", seq_len), ("num_train", num_train), ("num_val", num_val)]:
        require(f"data.{key}", value, _is_int(value) and value >= 1, "an integer >= 1")
    require(
        "data.vocab_size", vocab_size, _is_int(vocab_size) and vocab_size >= 2, "an integer >= 2"
    )
    require(
        "data.branching",
        branching,
        _is_int(branching) and branching >= 1,
        "an integer >= 1 (and <= data.vocab_size)",
    )
    require(
        "data.branching",
        branching,
        branching <= vocab_size,
        f"at most data.vocab_size={vocab_size}",
    )
    language = markov_language(vocab_size, branching, data_seed)
    train_seq = copy_task_sequences(num_train, seq_len + 1, language, data_seed + 1)
    val_seq = copy_task_sequences(num_val, seq_len + 1, language, data_seed + 2)
    return make_loaders(
        TensorDataset(train_seq[:, :-1], train_seq[:, 1:]),
        TensorDataset(val_seq[:, :-1], val_seq[:, 1:]),
        batch_size=batch_size,
        val_batch_size=val_batch_size,
        seed=seed,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


# Arguments that may change when a run resumes (the data order does not depend on them).
tokens.resume_may_change = LOADER_KEYS


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
