"""What the debug presets switch on (``debug=fast|overfit|anomaly|profile``,
configs/debug/; ``debug=none``: nothing): the first N batches of a split (the same
ones every epoch for ``overfit``, and validation on them), autograd anomaly
detection, and the torch profiler over a window of steps after warm-up, writing
a Chrome/TensorBoard trace and a table of the top ops into ``<run dir>/profile/``
(on CUDA also a memory snapshot when memory runs out). docs/debug.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    Subset,
)

from . import samplers
from .config import ConfigError
from .schema import section

log = logging.getLogger(__name__)


def first_batches(loader: DataLoader, batches: int) -> DataLoader:
    """A loader like ``loader`` (its collate_fn, workers, generator) over its first
    ``batches`` batches: the dataset's first ones, shuffled every epoch if the loader
    shuffles; with a sampler of the data's own, the samples it draws first (epoch 0),
    shuffled so; with a batch sampler, its first batches, the same every epoch."""
    if isinstance(loader.dataset, IterableDataset):
        raise ConfigError(
            "debug.*_batches needs a dataset with a length, not a stream (an "
            "IterableDataset): shorten a stream's run with trainer.max_steps instead"
        )
    common = {
        "generator": loader.generator,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "worker_init_fn": loader.worker_init_fn,
        "persistent_workers": loader.persistent_workers,
    }
    order = loader.batch_sampler
    if type(order) is BatchSampler and isinstance(order.sampler, RandomSampler | SequentialSampler):
        count = min(len(loader.dataset), batches * loader.batch_size)
        subset = Subset(loader.dataset, range(count))
        shuffle = isinstance(order.sampler, RandomSampler)
        return DataLoader(
            subset,
            batch_size=loader.batch_size,
            shuffle=shuffle,
            drop_last=loader.drop_last,
            **common,
        )
    drawn = samplers.first_batches_drawn(loader, batches)
    subset = Subset(loader.dataset, [index for batch in drawn for index in batch])
    if type(order) is BatchSampler:  # a sampler of the data's own, batched by batch_size
        return DataLoader(
            subset, batch_size=loader.batch_size, shuffle=True, drop_last=loader.drop_last, **common
        )
    # the batch sampler's batches as positions in the subset (a list is a batch sampler)
    starts = [0, *itertools.accumulate(len(batch) for batch in drawn)]
    fixed = [list(range(a, b)) for a, b in itertools.pairwise(starts)]
    return DataLoader(subset, batch_sampler=fixed, **common)


class Debug:
    """The ``debug`` config section; every verb is a no-op for ``debug=none``."""

    def __init__(self, settings: Any, *, run_dir: Path, rank: int = 0) -> None:
        """``settings``: the ``debug`` group (schema/run.py, which checks its values)."""
        settings = section("debug", settings)
        self.train_batches, self.val_batches = settings.train_batches, settings.val_batches
        self.val_on_train, self.detect_anomaly = settings.val_on_train, settings.detect_anomaly
        self.profile = settings.profile  # None: no profiler; else debug.profile's window
        self.dir = Path(run_dir) / "profile"
        self.rank = rank
        self._profiler: Any = None

    def loaders(self, loaders: Any) -> Any:
        """The data module's loaders (a dataclass such as data.DataLoaders), cut
        to the configured batches; untouched without those keys."""
        if not (self.train_batches or self.val_batches or self.val_on_train):
            return loaders
        train, val = loaders.train, loaders.val
        if self.train_batches:
            train = first_batches(train, self.train_batches)
            log.info(f"debug: training on the first {len(train.dataset)} samples, every epoch")
        if self.val_on_train:
            val = DataLoader(train.dataset, batch_size=val.batch_size, collate_fn=val.collate_fn)
            log.info("debug: validating on the training samples")
        elif self.val_batches:
            val = first_batches(val, self.val_batches)
            log.info(f"debug: validating on the first {len(val.dataset)} samples")
        return dataclasses.replace(loaders, train=train, val=val)

    def start(self) -> None:
        """Before the loop."""
        if self.detect_anomaly:
            torch.autograd.set_detect_anomaly(True, check_nan=True)
            log.info("debug: autograd anomaly detection on (slow): a NaN in backward names its op")
        if self.profile:
            self._start_profiler()

    def on_step_end(self, run: Any) -> None:
        """The loop's event (callbacks.py): a step was taken (the profiler's window)."""
        self.step()

    def step(self) -> None:
        """After every optimizer step."""
        if self._profiler is not None:
            self._profiler.step()

    def finish(self) -> None:
        """After the loop."""
        if self.detect_anomaly:
            torch.autograd.set_detect_anomaly(False)
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
            self._record_memory_on_oom()
        p = self.profile
        self._profiler = profile(
            activities=activities,
            schedule=schedule(wait=p.wait, warmup=p.warmup, active=p.active, repeat=1),
            on_trace_ready=self._write,
            record_shapes=p.record_shapes,
            profile_memory=p.profile_memory,
        )
        self._profiler.start()
        log.info(
            f"debug: profiling steps {p.wait + p.warmup + 1}..{p.wait + p.warmup + p.active} "
            f"into {self.dir}"
        )

    def _write(self, prof: Any) -> None:
        """The trace (chrome://tracing, Perfetto, TensorBoard) and the top-ops table."""
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=self.profile.row_limit)
        (self.dir / f"top_ops_rank{self.rank}.txt").write_text(table + "\n")
        log.info(f"debug: profiler trace {trace}, top ops {self.dir}/top_ops_rank{self.rank}.txt")

    def _record_memory_on_oom(self) -> None:
        """CUDA: keep the allocator's history; on out-of-memory dump a snapshot
        (open it at https://pytorch.org/memory_viz)."""
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        path = self.dir / f"oom_snapshot_rank{self.rank}.pickle"

        def dump(*_: Any) -> None:
            self.dir.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            log.error(f"debug: out of CUDA memory: snapshot in {path}")

        torch._C._cuda_attach_out_of_memory_observer(dump)
