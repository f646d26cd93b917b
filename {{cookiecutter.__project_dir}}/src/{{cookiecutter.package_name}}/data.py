"""The example task's data: the 8x8 handwritten digits shipped in ``assets/``.

``assets/digits.csv.gz`` is the UCI "Optical Recognition of Handwritten Digits"
test set (1797 images, 64 pixels in 0..16, then the label; CC BY 4.0, E. Alpaydin
and C. Kaynak), the same file scikit-learn ships, so training needs no network.

Replace this module with your own data; keep the two properties that make runs
reproducible and resumable:
- the training order comes from a dedicated generator (not the global RNG),
  seeded with ``seed`` and reseeded per epoch by ``set_epoch``;
- anything random per sample (augmentation) is a function of (seed, epoch, index).
"""

import gzip
from dataclasses import dataclass
from importlib import resources

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from .seeding import seed_worker


@dataclass
class DataLoaders:
    train: DataLoader
    val: DataLoader


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
    pin_memory: bool = False,
) -> DataLoaders:
    """Train/validation loaders over a fixed split (``split_seed``, not ``seed``,
    so validation scores compare across training seeds)."""
    images, labels = load_digits()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    n_val = round(len(labels) * val_fraction)
    val_idx, train_idx = order[:n_val], order[n_val:]
    common = {
        "num_workers": num_workers,
        "pin_memory": pin_memory,
        "worker_init_fn": seed_worker,
        "persistent_workers": num_workers > 0,
    }
    train = DataLoader(
        TensorDataset(images[train_idx], labels[train_idx]),
        batch_size=batch_size,
        shuffle=True,
        drop_last=False,
        # Own generator: the shuffle and the workers' base seed never touch
        # (or depend on) the global RNG. accelerate reseeds it per epoch.
        generator=torch.Generator().manual_seed(seed),
        **common,
    )
    val = DataLoader(
        TensorDataset(images[val_idx], labels[val_idx]),
        batch_size=val_batch_size,
        shuffle=False,
        generator=torch.Generator().manual_seed(seed),
        **common,
    )
    return DataLoaders(train=train, val=val)
