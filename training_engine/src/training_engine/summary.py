"""What ``summary.json`` holds: a finished run's commit record, written last at its end
(``run_summary``, then trainer.finish adds the final weights' entry), and what a rerun
of a finished run says (``report_finished``). docs/run-dir.md."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .recovery import history

log = logging.getLogger("train")


def report_finished(run_dir: Path, summary: dict) -> float | None:
    """A rerun of a finished run: say so, change nothing; its best value for sweepers."""
    best = summary["best"]
    log.info(
        f"{run_dir} is a finished run (step {summary['step']}, best {best['name']} "
        f"{best['value']} at step {best['step']}): nothing to do, nothing changed. Raise "
        "trainer.max_steps/max_epochs to continue it, or use another run_name"
    )
    return best["value"]


def run_summary(trainer: Any, step: int, wall: float) -> dict[str, Any]:
    """The summary of ``trainer``'s run (a Trainer) at its end, after ``wall`` seconds
    of its loop in every attempt."""
    data = trainer.data
    if data is None and step > 0:  # an end completed from the last checkpoint: no
        data = next(iter(trainer.train_loader))  # batch seen here; one, to size the rates
    samples, tokens = trainer.task.batch_size(batch=data) if data is not None else (0, None)
    excluded = trainer.clock.excluded_s
    return {
        "step": step,
        "epoch": trainer.epoch + 1,
        "world_size": trainer.accelerator.num_processes,
        "wall_time_s": round(wall, 3),  # the whole run's loop (every attempt)
        "steps_per_sec": round(step / wall, 3) if wall > 0 else 0.0,  # over wall_time_s
        # the same run's rates over training time only, and what was left out
        "rates": trainer.throughput.summary(
            step, wall, excluded, samples, tokens, trainer.grad_accum
        ),
        "metrics": trainer.book.last,
        "best": trainer.book.best(),
        "resumed_from": trainer.ckpt.resumed_from,  # null for a fresh start
        "skipped_nan_steps": trainer.guard.skipped,
        "recoveries": history(trainer.run_dir),  # in-job restarts, every launch's
        **trainer.fine_tuned,  # checkpoint.init_from: the source, the keys that did not fit
        **trainer.stopper.summary(),  # trainer.early_stopping: whether, when and why
    }
