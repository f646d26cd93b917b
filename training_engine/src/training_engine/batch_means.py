"""Means over a whole data set, the same on any number of processes: what task.py's
``evaluate`` averages its ``loss`` and logs with (through contract.py).

Every rank evaluates its share of the batches; each batch's values are weighted by
its count (tokens or samples) and summed in float64 in the loader's own batch order,
so one process and eight give the same numbers (bit for bit where the per-batch
values are: the batches hold the same samples whatever the world size). The samples
the distributed sampler repeats to even out the last batch are dropped before the
model sees them, except on a rank left with none, which still runs the batch (sharded
models need every rank in each forward) and counts nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def loss_and_logs(result: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """task.loss's result as (loss, logs): it may return the loss alone."""
    return result if isinstance(result, tuple) else (result, {})


@torch.no_grad()
def average_over_batches(
    values: Callable[[Any], Any],
    loader: Any,
    accelerator: Any,
    count: Callable[[Any], int],
) -> dict[str, float]:
    """``{"loss": mean, name: mean, ...}`` of ``values(batch)`` (a loss, or (loss, logs))
    over every batch of ``loader``, weighted by ``count(batch)``. A collective: call on
    every rank."""
    rank, world = accelerator.process_index, accelerator.num_processes
    rows: list[tuple[int, int, dict[str, float]]] = []
    for j, batch in enumerate(loader):
        kept = _real_samples(batch, loader, accelerator)
        batch = batch if kept is None or kept == 0 else _head(batch, kept)
        loss, logs = loss_and_logs(values(batch))
        weight = 0 if kept == 0 else count(batch)
        scalars = {"loss": float(loss), **{k: float(v) for k, v in logs.items()}}
        rows.append((j * world + rank, weight, scalars))
    if world > 1:
        from accelerate.utils import gather_object

        rows = gather_object(rows)
    total = sum(weight for _, weight, _ in rows)
    sums: dict[str, float] = {}
    for _, weight, scalars in sorted(rows, key=lambda row: row[0]):
        for name, value in scalars.items():
            sums[name] = sums.get(name, 0.0) + weight * value
    return {name: value / total for name, value in sums.items()} if total else {}


def _real_samples(batch: Any, loader: Any, accelerator: Any) -> int | None:
    """How many samples of this rank's batch are real: all (None) but in the last batch
    of a loader accelerate prepared, of whose gathered batch the first ``remainder``
    samples are (the loader's own state, as accelerate's gather_for_metrics reads it)."""
    if accelerator.num_processes == 1 or not getattr(loader, "end_of_dataloader", False):
        return None
    remainder = getattr(loader, "remainder", -1)
    if remainder <= 0:
        return None  # the last batch was full: nothing repeated
    size = _length(batch)
    return max(0, min(size, remainder - accelerator.process_index * size))


def _length(batch: Any) -> int:
    if isinstance(batch, torch.Tensor) or _per_sample(batch):
        return len(batch)
    if isinstance(batch, dict):
        return _length(next(iter(batch.values())))
    return _length(batch[0])


def _head(batch: Any, n: int) -> Any:
    """The first ``n`` samples of a batch (tensors, or tuples/lists/dicts of them; a
    list of plain values, e.g. a collate's ids or texts, is one per sample)."""
    if isinstance(batch, torch.Tensor) or _per_sample(batch):
        return batch[:n]
    if isinstance(batch, dict):
        return type(batch)((k, _head(v, n)) for k, v in batch.items())
    if isinstance(batch, list | tuple):
        return type(batch)(_head(v, n) for v in batch)
    return batch


def _per_sample(batch: Any) -> bool:
    """A list or tuple of plain values (not tensors or containers of them)."""
    containers = torch.Tensor | dict | list | tuple
    return isinstance(batch, list | tuple) and not any(isinstance(v, containers) for v in batch)
