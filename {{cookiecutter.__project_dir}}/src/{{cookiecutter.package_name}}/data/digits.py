"""The digits example's data (``data=digits``): the 8x8 handwritten digits shipped in
``assets/``.

``assets/digits.csv.gz`` is the UCI "Optical Recognition of Handwritten Digits"
test set (1797 images, 64 pixels in 0..16, then the label; CC BY 4.0, E. Alpaydin
and C. Kaynak), the same file scikit-learn ships, so training needs no network.

Your own data is a module like this one: a function returning
``contract.make_loaders(...)``, which applies the rules that make runs reproducible
and resumable (docs/data.md). Data on disk: the engine's ``training_engine.token_file``
(``data=token_file``), ``hf.py`` (``data=hf``); a stream: ``token_file.TokenStream``.
"""

import gzip
from importlib import resources

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ..contract import LOADER_KEYS, DataLoaders, make_loaders, require


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """Images as float32 (N, 1, 8, 8) scaled to [0, 1], labels as int64 (N,)."""
    with (
        resources.files(__package__).joinpath("assets/digits.csv.gz").open("rb") as raw,
        gzip.open(raw) as text,
    ):
        table = np.loadtxt(text, delimiter=",", dtype=np.float32)
    images = torch.from_numpy(table[:, :64] / 16.0).reshape(-1, 1, 8, 8)
    labels = torch.from_numpy(table[:, 64].astype(np.int64))
    return images, labels


def digits(
    batch_size: int,
    seed: int,
    val_batch_size: int = 512,
    val_fraction: float = 0.2,
    split_seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool | None = None,
) -> DataLoaders:
    """Train/validation loaders over a fixed split (``split_seed``, not ``seed``,
    so validation scores compare across training seeds)."""
    require(
        "data.val_fraction",
        val_fraction,
        _is_number(val_fraction) and 0 < val_fraction < 1,
        "a number between 0 and 1 (exclusive)",
    )
    images, labels = load_digits()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    n_val = round(len(labels) * val_fraction)
    val_idx, train_idx = order[:n_val], order[n_val:]
    return make_loaders(
        TensorDataset(images[train_idx], labels[train_idx]),
        TensorDataset(images[val_idx], labels[val_idx]),
        batch_size=batch_size,
        val_batch_size=val_batch_size,
        seed=seed,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


# Arguments that may change when a run resumes (the data order does not depend on
# them); the checkpoint's config check reads this from the ``_target_``.
digits.resume_may_change = LOADER_KEYS


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
