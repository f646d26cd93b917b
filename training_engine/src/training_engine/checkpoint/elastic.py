"""Resuming on another number of processes ("elastic" resume).

The data position is kept as global samples consumed in the epoch, so a resume
on M processes continues the same epoch order from the same sample; the global
batch (processes x per-process batch x accumulation) is kept by adjusting the
gradient accumulation when it divides, else it changes with a warning. Also
which checkpoints ``checkpoint.resume`` names (resume.py chooses among them).
docs/checkpoints.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import folder
from . import format as fmt


def per_process_batch(loader: Any, num_processes: int) -> int:
    """Samples per micro-batch on one process (accelerate's prepared loader
    knows the global one); 1 for a batch sampler's batches of any size, so that the
    position counts batches."""
    try:
        total = getattr(loader, "total_batch_size", None)
    except TypeError:  # accelerate multiplies the batch sampler's batch_size: None
        total = None
    if total:
        return max(1, int(total) // num_processes)
    return int(getattr(loader, "batch_size", None) or 1)


def resume_batch(
    trainer: dict[str, Any],
    *,
    saved_world: int,
    world: int,
    batch_size: int,
    batches_per_epoch: int | None,
) -> tuple[int, str | None]:
    """Micro-batches of the saved epoch this process skips now, and a warning
    when the samples consumed are not a whole number of this world's global
    micro-batches (the rest, fewer than ``world`` micro-batches, is trained again).
    A finished epoch stays finished; the same world size gives the saved batch."""
    batch = int(trainer["batch"])
    saved_batches = trainer.get("batches_per_epoch", batch + 1)  # None: a stream
    if saved_batches is not None and batch >= int(saved_batches):
        return batches_per_epoch, None  # the epoch is done on any world size
    samples = int(trainer.get("samples_in_epoch", batch * saved_world * batch_size))
    done, left = divmod(samples, world * batch_size)
    if not left:
        return done, None
    return done, (
        f"the checkpoint consumed {samples} samples of its epoch, not a multiple of "
        f"{world} processes x {batch_size} per batch: continuing after "
        f"{done * world * batch_size}, "
        f"so {left} samples of this epoch are trained a second time"
    )


def grad_accum_for(
    saved_world: int, saved_accum: int, world: int, configured: int
) -> tuple[int, str | None]:
    """The accumulation that keeps the saved global batch on ``world`` processes
    (same per-process batch), or ``configured`` and a warning when it cannot."""
    micro_batches = saved_world * saved_accum  # per optimizer step, whole world
    if micro_batches % world == 0:
        return micro_batches // world, None
    return configured, (
        f"the checkpoint's global batch is {saved_world} processes x {saved_accum} accumulated "
        f"micro-batches; {micro_batches} is not divisible by {world} processes, so the "
        f"global batch changes to {world} x {configured} micro-batches (the learning rate is "
        "not rescaled)"
    )


def effective_mode(mode: str, own_dir: Path) -> str:
    """``checkpoint.resume`` as it applies now: once this run dir has checkpoints
    of its own, a path outside it only started the run (``auto`` continues)."""
    if mode in ("auto", "never") or not folder.committed_checkpoints(own_dir):
        return mode
    inside = Path(mode).resolve().is_relative_to(own_dir.parent.resolve())
    return mode if inside else "auto"


def candidates(mode: str, own_dir: Path) -> list[Path]:
    """The checkpoints (oldest first) a resume with ``mode`` (auto or a path) tries."""
    if mode == "auto":
        return folder.committed_checkpoints(own_dir)
    try:
        return folder.find_checkpoints(Path(mode))
    except fmt.CheckpointError as err:
        raise fmt.CheckpointError(f"checkpoint.resume={err}") from None
