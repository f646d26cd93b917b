"""The data contract: what a data function returns (``DataLoaders``) and the one
helper that builds loaders with the rules that keep runs reproducible and resumable
(``make_loaders``), and what the loop asks of a loader: its length (none for a
stream: ``run_length``) and where a resumed epoch continues (``continue_epoch``).
docs/data.md.

A data function (``configs/data/<name>.yaml``'s ``_target_``) takes its YAML keys as
arguments, including ``batch_size`` and ``seed: ${seed}``, and returns
``make_loaders(train_set, val_set, ...)``. Batches are whatever ``task.py`` reads
(the examples: ``(inputs, targets)``).
"""

import math
import multiprocessing
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import skip_first_batches
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    SequentialSampler,
)

from . import samplers
from .config import ConfigError, require
from .seeding import seed_worker

# Data arguments that never change which samples a step sees: a resumed run may change
# them (a data function lists them as its ``resume_may_change``).
LOADER_KEYS = ("num_workers", "pin_memory", "val_batch_size")


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
    collate_fn: Callable[[list], Any] | None = None,
    val_collate_fn: Callable[[list], Any] | None = None,
    sampler: Sampler | None = None,
    batch_sampler: Sampler | None = None,
) -> DataLoaders:
    """Training and validation loaders for two datasets (map-style: ``__len__`` and
    ``__getitem__``; or iterable: a stream, e.g. ``token_file.TokenStream``):

    - the training order comes from the loader's own ``torch.Generator`` seeded with
      ``seed`` (never the global RNG); accelerate reseeds it per epoch, so the order
      is a function of (seed, epoch) and a resumed run sees the same batches;
    - every worker process is seeded from it (``seeding.seed_worker``);
    - workers persist across epochs, batches are page-locked when a GPU is present.

    Anything random per sample (augmentation, a random window) must be a function of
    (seed, epoch, index) computed in the dataset, not of the global RNG.

    ``collate_fn`` makes a batch of samples (padding, dict batches; default: torch's);
    ``val_collate_fn`` the validation batches (default: ``collate_fn``). With workers
    started by spawn or forkserver (macOS, Windows, Python >= 3.14) both must pickle:
    a module-level function or class, not a lambda. A training ``sampler`` (indices;
    ``batch_size`` still batches them) or ``batch_sampler`` (whole batches; then
    ``batch_size`` only sets the validation batch) keeps the guarantees above when its
    order can be made a function of (seed, epoch): one with a ``generator`` (torch's
    samplers) is given the loader's own when it has none and reseeded every epoch; one
    with ``set_epoch(epoch)`` is told the epoch (its order must then follow from this
    ``seed``). Resume skips exactly the batches trained, on any number of processes,
    and accelerate shards a batch sampler's batches whatever their sizes. Refused,
    with the guarantee lost: one with neither (e.g. global-RNG draws), a
    ``DistributedSampler`` (sharded twice), one without ``__len__``, either with a
    stream (training_engine/samplers.py)."""
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
        # No worker start-up every epoch; but a stream's workers are started per epoch,
        # so that each gets the dataset's epoch and resume point (set_epoch, skip).
        "persistent_workers": num_workers > 0 and not isinstance(train_set, IterableDataset),
    }
    val_collate_fn = collate_fn if val_collate_fn is None else val_collate_fn
    for key, fn in [("collate_fn", collate_fn), ("val_collate_fn", val_collate_fn)]:
        _check_collate(key, fn, num_workers)
    if sampler is not None and batch_sampler is not None:
        raise ConfigError(
            "make_loaders(sampler=..., batch_sampler=...) is not allowed: a batch sampler "
            "draws the indices itself; expected one of them"
        )
    # Own generator: the shuffle and the workers' base seed never touch
    # (or depend on) the global RNG. accelerate reseeds it per epoch.
    generator = torch.Generator().manual_seed(seed)
    # An iterable dataset has its own order (token_file.TokenStream); no shuffling.
    order: dict[str, Any] = {
        "batch_size": batch_size,
        "shuffle": not isinstance(train_set, IterableDataset),
        "drop_last": False,
    }
    rules = {"dataset": train_set, "seed": seed, "generator": generator}
    if sampler is not None:
        order = {"batch_size": batch_size, "sampler": samplers.seeded("sampler", sampler, **rules)}
    elif batch_sampler is not None:
        order = {"batch_sampler": samplers.seeded("batch_sampler", batch_sampler, **rules)}
    train = DataLoader(train_set, generator=generator, collate_fn=collate_fn, **order, **common)
    val = DataLoader(
        val_set,
        batch_size=val_batch_size,
        shuffle=False,
        generator=torch.Generator().manual_seed(seed),
        collate_fn=val_collate_fn,
        **common,
    )
    return DataLoaders(train=train, val=val)


def batches_per_epoch(loader: Any) -> int | None:
    """Micro-batches of one epoch on this process; None for a stream (no length)."""
    try:
        return len(loader)
    except TypeError:  # an IterableDataset without __len__
        return None


@dataclass
class RunPlan:
    """The loop's length and cadence, decided once (``run_length``): the loop runs it,
    preflight's ETA and the checkpoint plan ask it."""

    steps_per_epoch: int | None  # None: a stream (no epoch length)
    total_steps: int
    max_epochs: int  # epochs to loop over
    grad_accum: int  # micro-batches per optimizer step (elastic resume may change it)
    eval_every: int  # optimizer steps between evaluations (and always at the end)

    def evaluations(self, start_step: int) -> set[int]:
        """The steps in (start_step, total_steps] that evaluate."""
        if start_step >= self.total_steps:
            return set()  # a finished run resumed: nothing left to do
        every = self.eval_every
        first = (start_step // every + 1) * every
        return set(range(first, self.total_steps + 1, every)) | {self.total_steps}


def run_length(
    *,
    max_steps: int | None,
    max_epochs: int,
    batches: int | None,
    grad_accum: int,
    eval_every_n_steps: int | None = None,
) -> RunPlan:
    """The run's plan. A stream has no length, so ``trainer.max_steps`` sets the run's;
    its epochs are passes over the stream (every pass of a finite one holds at least
    one step). Evaluations: every ``eval_every_n_steps``, else every epoch, else (a
    stream) at the end."""
    if batches is None:
        if not max_steps:
            raise ConfigError(
                f"trainer.max_steps={max_steps!r} is not allowed with a training set that has "
                "no length (an IterableDataset, a stream): expected trainer.max_steps=N, "
                "the run's length in optimizer steps"
            )
        per_epoch, total, epochs = None, max_steps, max_steps
    else:
        per_epoch = math.ceil(batches / grad_accum)
        total = max_steps or max_epochs * per_epoch
        epochs = math.ceil(total / per_epoch)
    every = eval_every_n_steps or per_epoch or total
    return RunPlan(per_epoch, total, epochs, grad_accum, every)


def continue_epoch(loader: Any, *, epoch: int, batches_done: int, num_processes: int) -> Any:
    """The loader for the rest of an epoch of which this process already trained
    ``batches_done`` micro-batches. A stream with ``skip_to(epoch, samples)`` (e.g.
    ``token_file.TokenStream``) is asked to continue after that many samples of
    the whole run's stream; any other loader reads the first batches again and drops
    them (accelerate's ``skip_first_batches``)."""
    samplers.set_epoch(loader, epoch)  # a batch sampler on 2 processes: nobody else does
    if not batches_done:
        return loader
    dataset = getattr(loader, "dataset", None)
    dataset = getattr(dataset, "dataset", dataset)  # accelerate's IterableDatasetShard
    # (skip_to, not skip: a Hugging Face IterableDataset has a skip(n) of its own)
    if isinstance(dataset, IterableDataset) and hasattr(dataset, "skip_to"):
        # Every process's micro-batch came from the one stream (the main process reads
        # them all for a stream: accelerate's dispatch), loader.batch_size per process.
        dataset.skip_to(epoch, batches_done * loader.batch_size * num_processes)
        return loader
    return skip_first_batches(loader, batches_done)


def in_dataset_order(loader: DataLoader) -> DataLoader:
    """``loader``, or a loader over its samples in dataset order when its sampler or
    batch sampler reorders them (predict.py's row index is the dataset's index): the
    same collate_fn and workers; the batch size, or the batch sampler's if it names one
    (else 1)."""
    batches = loader.batch_sampler
    plain = isinstance(loader.sampler, SequentialSampler) and type(batches) is BatchSampler
    if plain or isinstance(loader.dataset, IterableDataset):
        return loader
    inner = batches.inner if isinstance(batches, samplers.EpochSeeded) else batches
    named = getattr(inner, "batch_size", None)
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size or named or 1,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
    )


def _check_collate(key: str, fn: Any, num_workers: int) -> None:
    if fn is not None and not callable(fn):
        raise ConfigError(
            f"make_loaders({key}={fn!r}) is not allowed: expected a function of a list of "
            "samples (or None: torch's default_collate)"
        )
    started = multiprocessing.get_start_method(allow_none=True)
    started = started or multiprocessing.get_all_start_methods()[0]  # the default
    if fn is None or num_workers == 0 or started == "fork":
        return  # forked workers inherit it; no pickling
    try:
        pickle.dumps(fn)
    except Exception as err:  # pickle raises several types (PicklingError, AttributeError)
        raise ConfigError(
            f"make_loaders({key}={fn!r}) is not allowed with num_workers={num_workers}: "
            f"workers started by {started} receive it pickled ({err}); expected a "
            "module-level function or class instance"
        ) from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
