"""A data function's own training ``sampler`` or ``batch_sampler`` (``make_loaders``)
held to the order rules of the default shuffle: the order of epoch e is a function of
(seed, e) from the loader's own generator, the same on every process, so a resumed
run sees the same batches and accelerate shards them without a gap or a repeat.
What accelerate does on its own, and why each rule here (docs/data.md):

- a sampler that draws from the global RNG (torch's samplers without a ``generator``)
  orders each process differently: two processes trained 15 of 20 samples;
- a sampler with a seeded generator of its own continues it across epochs: a resumed
  epoch 1 replays epoch 0;
- a batch sampler's ``set_epoch`` is called on one process, never on two (accelerate's
  ``BatchSamplerShard`` hides it);
- a batch sampler naming a ``batch_size`` has, on two processes, the batches of
  another size dropped (bucketing into 8, 6 and 6: 16 of 20 samples trained).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import DistributedSampler, IterableDataset, Sampler, SequentialSampler

from .config import ConfigError
from .per_sample import EpochIndices


@runtime_checkable
class Seedable(Protocol):
    """A sampler drawing from ``generator`` (torch's Random/WeightedRandom/SubsetRandom
    samplers): reseeded with seed + epoch before every pass; given the loader's own
    generator when it is None."""

    generator: torch.Generator | None


@runtime_checkable
class EpochAware(Protocol):
    """A sampler whose order is a function of its own seed and the epoch it is told."""

    def set_epoch(self, epoch: int) -> None: ...


class EpochSeeded(Sampler):
    """``inner``'s order for the epoch of ``set_epoch``: at the start of every pass its
    generator is reseeded with ``seed + epoch`` (accelerate's ``SeedableRandomSampler``
    rule, so a ``RandomSampler`` orders exactly as the default shuffle) and its own
    ``set_epoch`` is called. It names no ``batch_size``: accelerate then shards a batch
    sampler's batches whatever their sizes."""

    def __init__(self, inner: Any, *, seed: int, generator: torch.Generator) -> None:
        self.inner, self.seed, self.epoch = inner, seed, 0
        if isinstance(inner, Seedable) and inner.generator is None:
            inner.generator = generator  # never the global RNG

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        generator = getattr(self.inner, "generator", None)
        if isinstance(generator, torch.Generator):
            generator.manual_seed(self.seed + self.epoch)
        if isinstance(self.inner, EpochAware):
            self.inner.set_epoch(self.epoch)
        yield from self.inner


def seeded(which: str, order: Any, *, dataset: Any, seed: int, generator: torch.Generator) -> Any:
    """``order`` (the ``sampler`` or ``batch_sampler`` given to make_loaders) under
    the rules above, or a ConfigError naming the guarantee it would lose."""
    kind = type(order).__name__

    def refuse(why: str, expected: str) -> ConfigError:
        return ConfigError(
            f"make_loaders({which}={kind}) is not allowed: {why}; expected {expected}"
        )

    if isinstance(dataset, IterableDataset):
        raise refuse("a stream (an IterableDataset) has its own order", f"no {which}")
    if isinstance(order, DistributedSampler):
        raise refuse(
            "accelerate shards the batches across processes itself, a DistributedSampler "
            "would shard them twice (each process training 1/N of its share)",
            "the sampler it wraps",
        )
    try:
        len(order)
    except TypeError:
        raise refuse(
            "it has no __len__, and the run's plan, checkpoints and resume count the "
            "epoch's batches",
            "a sampler with __len__",
        ) from None
    if isinstance(order, SequentialSampler):
        return order  # no randomness
    own = getattr(order, "generator", False)  # False: no such attribute
    seedable = own is None or isinstance(own, torch.Generator)
    if not (seedable or isinstance(order, EpochAware)):
        raise refuse(
            "its order would not be a function of (seed, epoch): a resumed run would not "
            "see the same batches, and processes would not agree on the order (samples "
            "trained twice or never)",
            "a `generator` attribute (reseeded from (seed, epoch) every epoch; the "
            "loader's own when None) or a `set_epoch(epoch)` method (its order a "
            "function of the data function's seed and the epoch)",
        )
    return EpochSeeded(order, seed=seed, generator=generator)


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell the loader's ``EpochSeeded`` and ``per_sample.EpochIndices`` the epoch,
    wherever accelerate nested them (skip > shard > indices > batch sampler >
    sampler): its own ``set_epoch`` misses a batch sampler on two processes."""
    found = getattr(loader, "batch_sampler", None)
    for _ in range(8):  # a few levels; never loops on a sampler that names itself
        if found is None:
            break
        if isinstance(found, EpochSeeded | EpochIndices):
            found.set_epoch(epoch)
        inner = getattr(found, "batch_sampler", None)
        found = inner if inner is not None else getattr(found, "sampler", None)


def first_batches_drawn(loader: Any, batches: int) -> list[list[int]]:
    """The dataset indices of the first ``batches`` batches of the loader's epoch 0."""
    set_epoch(loader, 0)
    return [list(batch) for batch in islice(iter(loader.batch_sampler), batches)]
