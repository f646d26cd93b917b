"""The data contract: what a data function returns (``DataLoaders``) and the one
helper that builds loaders with the rules that keep runs reproducible and resumable
(``make_loaders``). README: "Your own data".

A data function (``configs/data/<name>.yaml``'s ``_target_``) takes its YAML keys as
arguments, including ``batch_size`` and ``seed: ${seed}``, and returns
``make_loaders(train_set, val_set, ...)``. Batches are whatever ``task.py`` reads
(the examples: ``(inputs, targets)``).
"""

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .config import require
from .seeding import seed_worker


@dataclass
class DataLoaders:
    train: DataLoader
    val: DataLoader


def make_loaders(
    train_set: Dataset | IterableDataset,
    val_set: Dataset | IterableDataset,
    *,
    batch_size: int,
    seed: int,
    val_batch_size: int | None = None,
    num_workers: int = 0,
    pin_memory: bool | None = None,
) -> DataLoaders:
    """Training and validation loaders for two datasets (map-style: ``__len__`` and
    ``__getitem__``; or iterable, see ``streaming.py``):

    - the training order comes from the loader's own ``torch.Generator`` seeded with
      ``seed`` (never the global RNG); accelerate reseeds it per epoch, so the order
      is a function of (seed, epoch) and a resumed run sees the same batches;
    - every worker process is seeded from it (``seeding.seed_worker``);
    - workers persist across epochs, batches are page-locked when a GPU is present.

    Anything random per sample (augmentation, a random window) must be a function of
    (seed, epoch, index) computed in the dataset, not of the global RNG."""
    val_batch_size = batch_size if val_batch_size is None else val_batch_size
    for key, value in [("batch_size", batch_size), ("val_batch_size", val_batch_size)]:
        require(f"data.{key}", value, _is_int(value) and value >= 1, "an integer >= 1")
    require(
        "data.num_workers",
        num_workers,
        _is_int(num_workers) and num_workers >= 0,
        "an integer >= 0",
    )
    common = {
        "num_workers": num_workers,
        # Page-locked batches make the copy to the GPU asynchronous (accelerate
        # moves them with non_blocking=True); pointless without a GPU.
        "pin_memory": torch.cuda.is_available() if pin_memory is None else pin_memory,
        "worker_init_fn": seed_worker,
        "persistent_workers": num_workers > 0,  # no worker start-up every epoch
    }
    train = DataLoader(
        train_set,
        batch_size=batch_size,
        # An iterable dataset has its own order (streaming.py); a loader cannot shuffle it.
        shuffle=not isinstance(train_set, IterableDataset),
        drop_last=False,
        # Own generator: the shuffle and the workers' base seed never touch
        # (or depend on) the global RNG. accelerate reseeds it per epoch.
        generator=torch.Generator().manual_seed(seed),
        **common,
    )
    val = DataLoader(
        val_set,
        batch_size=val_batch_size,
        shuffle=False,
        generator=torch.Generator().manual_seed(seed),
        **common,
    )
    return DataLoaders(train=train, val=val)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
