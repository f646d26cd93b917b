"""Each sample's randomness a function of (seed, epoch, index), for any map-style
dataset, with no code from its owner: torchvision, timm, kornia or albumentations
augmentation, and ``random``/``numpy.random``/``torch`` draws in ``__getitem__``,
resume bit-exactly and are the same on any number of processes and workers.

Why by hand: a loader fetches ahead (accelerate's loader one batch, workers
``prefetch_factor`` batches), so a checkpoint's global RNG state already holds the
next batches' draws, and a worker's RNG depends on which batches it happened to
fetch. Neither torch nor accelerate reseeds per sample.

How: the training batch sampler's indices travel as ``(epoch, index)`` pairs
(``EpochIndices``), into workers too, and the dataset (``SeededItems``) fetches
each under python's, numpy's and torch's CPU RNG seeded from (seed, epoch, index),
then, in the main process, restores the global state it found: the training step's
own draws (dropout) never see the data's. The collate function runs the same way,
seeded by the batch's first sample (mixup in a collate). A dataset with
``set_epoch(epoch)`` is told the epoch in the process that fetches, so a worker's
copy sees it too. docs/data.md.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Subset,
    TensorDataset,
    default_collate,
    get_worker_info,
)

log = logging.getLogger(__name__)

_MASK = (1 << 64) - 1


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed for one sample: SplitMix64's finaliser over the three in turn
    (neighbouring indices and epochs get unrelated streams)."""
    x = 0
    for part in (seed, epoch, index):
        x = (x ^ (part & _MASK)) + 0x9E3779B97F4A7C15 & _MASK
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
        x ^= x >> 31
    return x


class _Isolated:
    """Seed python's, numpy's and torch's CPU RNG per draw; in the main process the
    global state found on entry is put back on exit (a worker has no state to keep:
    every sample reseeds it)."""

    def __enter__(self) -> _Isolated:
        self.saved = None
        if get_worker_info() is None:
            self.saved = (
                torch.default_generator.get_state(),
                random.getstate(),
                np.random.get_state(),
            )
        return self

    @staticmethod
    def seed(value: int) -> None:
        torch.default_generator.manual_seed(value)  # CPU only: CUDA's is the step's
        random.seed(value)
        np.random.seed(value & 0xFFFFFFFF)

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            torch_state, python_state, numpy_state = self.saved
            torch.default_generator.set_state(torch_state)
            random.setstate(python_state)
            np.random.set_state(numpy_state)


class _Fetched(list):
    """A batch's samples, with the (epoch, index) keys they were fetched for."""

    keys: list[tuple[int, int]]


class SeededItems(Dataset):
    """``dataset`` fetched by ``(epoch, index)`` keys, each under an RNG seeded from
    (seed, epoch, index). Other attributes are the dataset's own."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed, self.epoch = dataset, seed, None
        self.receiver = epoch_receiver(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Any) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        fetched = _Fetched()
        fetched.keys = []
        with _Isolated() as rng:
            for key in keys:
                epoch, index = key if isinstance(key, tuple) else (0, key)
                if self.receiver is not None and epoch != self.epoch:
                    self.receiver.set_epoch(epoch)  # in this process: a worker's copy too
                    self.epoch = epoch
                rng.seed(sample_seed(self.seed, epoch, index))
                fetched.append(self.dataset[index])
                fetched.keys.append((epoch, index))
        return fetched

    def __getattr__(self, name: str) -> Any:
        # the dataset's attributes (classes, vocabulary); never set_epoch, which
        # accelerate would call in the main process only (the fetch calls it)
        if name.startswith("__") or name in {"dataset", "seed", "epoch", "receiver", "set_epoch"}:
            raise AttributeError(name)
        return getattr(self.dataset, name)


class SeededCollate:
    """``collate_fn`` (torch's default when None) run under an RNG seeded from the
    batch's first key, so random batch-level augmentation (mixup) is exact too."""

    def __init__(self, collate_fn: Callable[[list], Any] | None, seed: int) -> None:
        self.collate_fn = collate_fn or default_collate
        self.seed = seed

    def __call__(self, samples: list) -> Any:
        keys = getattr(samples, "keys", None)
        if not keys:
            return self.collate_fn(samples)
        epoch, index = keys[0]
        with _Isolated() as rng:
            rng.seed(sample_seed(self.seed, epoch, index) ^ 0xC0117A7E)  # not the sample's
            return self.collate_fn(list(samples))


class EpochIndices(torch.utils.data.Sampler):
    """``batch_sampler``'s batches as ``(epoch, index)`` pairs, the epoch the one
    ``set_epoch`` gave before the pass. It shows accelerate the inner sampler
    (``sampler``, which accelerate may replace) and the inner batch size, as if it
    were not there."""

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler, self.epoch = batch_sampler, 0
        for key in ("batch_size", "drop_last"):
            if hasattr(batch_sampler, key):
                setattr(self, key, getattr(batch_sampler, key))

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @sampler.setter
    def sampler(self, sampler: Any) -> None:
        self.batch_sampler.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.epoch
        for batch in self.batch_sampler:
            yield [(epoch, int(index)) for index in batch]


def epoch_receiver(dataset: Any) -> Any:
    """The dataset (or one it wraps: Subset, debug's cut) with ``set_epoch``; None."""
    for _ in range(8):
        if hasattr(dataset, "set_epoch"):
            return dataset
        dataset = getattr(dataset, "dataset", None)
        if dataset is None:
            return None
    return None


def draws_nothing(dataset: Any) -> bool:
    """A dataset whose samples are plain tensor rows (a TensorDataset, or a Subset of
    one): nothing to seed, so its loader is left as it is (no per-sample cost)."""
    while type(dataset) is Subset:
        dataset = dataset.dataset
    return type(dataset) is TensorDataset


def exact_loader(loader: DataLoader, seed: int, *, what: str) -> DataLoader:
    """``loader`` with each sample's randomness a function of (seed, epoch, index);
    the same loader when there is nothing to make exact; a stream as it is, with one
    warning naming the guarantee it does not get (unless it declares
    ``draws_at_random = False``: its samples a function of its position alone)."""
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        if getattr(dataset, "draws_at_random", True):
            log.warning(
                f"data: the {what} set is a stream ({type(dataset).__name__}); its own random "
                "draws, if any, are not made a function of (seed, epoch, index): a resumed run "
                "is bit-exact only if they follow from its position (set "
                "`draws_at_random = False` on the class to say so)"
            )
        return loader
    if draws_nothing(dataset) or isinstance(dataset, SeededItems):
        return loader
    if loader.batch_sampler is None:  # batch_size=None: samples one at a time
        log.warning(
            f"data: the {what} loader has no batch sampler (batch_size=None); its samples' "
            "random draws are not made a function of (seed, epoch, index)"
        )
        return loader
    workers = loader.num_workers
    return DataLoader(
        SeededItems(dataset, seed),
        batch_sampler=EpochIndices(loader.batch_sampler),
        collate_fn=SeededCollate(loader.collate_fn, seed),
        num_workers=workers,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order,
    )


def exact_loaders(loaders: Any, seed: int) -> Any:
    """A data function's loaders (a dataclass with ``train``, ``val``, maybe ``test``)
    with every one made exact (``exact_loader``); anything else as it is."""
    if not dataclasses.is_dataclass(loaders):
        return loaders
    changes = {
        field.name: exact_loader(getattr(loaders, field.name), seed, what=field.name)
        for field in dataclasses.fields(loaders)
        if isinstance(getattr(loaders, field.name), DataLoader)
    }
    return dataclasses.replace(loaders, **changes)
