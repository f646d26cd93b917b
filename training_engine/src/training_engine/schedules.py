"""Learning-rate schedules, and when the loop steps them.

``train.py`` calls ``instantiate(cfg.scheduler)(optimizer, total_steps=...)``,
so every schedule here takes the optimizer and the total number of optimizer
steps; the remaining arguments come from ``configs/scheduler/``, and each schedule
checks its own (``require``: exit 2 naming the key). A schedule steps
after every optimizer step, except one that steps on a metric (torch's
``ReduceLROnPlateau``, ``plateau`` here): after every evaluation, with the value of
``trainer.monitor`` (``ScheduleSteps``, one of the loop's events).
"""

import functools
import math
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

from .config import require


def _constant_factor(step: int) -> float:
    return 1.0


def _warmup_cosine_factor(
    step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float
) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def constant(optimizer: Optimizer, total_steps: int) -> LambdaLR:
    """Keep the optimizer's learning rate."""
    return LambdaLR(optimizer, _constant_factor)


def warmup_cosine(
    optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warm-up for ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``."""
    whole = isinstance(warmup_steps, int) and not isinstance(warmup_steps, bool)
    require("scheduler.warmup_steps", warmup_steps, whole and warmup_steps >= 0, "an integer >= 0")
    number = isinstance(min_lr_ratio, int | float) and not isinstance(min_lr_ratio, bool)
    require(
        "scheduler.min_lr_ratio",
        min_lr_ratio,
        number and 0 <= min_lr_ratio <= 1,
        "a number in [0, 1]",
    )
    # A partial (not a lambda) so that LambdaLR.state_dict() holds plain data only.
    factor = functools.partial(
        _warmup_cosine_factor,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        min_lr_ratio=min_lr_ratio,
    )
    return LambdaLR(optimizer, factor)


def plateau(
    optimizer: Optimizer,
    total_steps: int,
    mode: str = "min",
    factor: float = 0.5,
    patience: int = 2,
    min_lr: float = 0.0,
) -> ReduceLROnPlateau:
    """Multiply the learning rate by ``factor`` after ``patience`` evaluations without
    an improvement of trainer.monitor (``mode``: its direction)."""
    return ReduceLROnPlateau(optimizer, mode=mode, factor=factor, patience=patience, min_lr=min_lr)


def steps_on_metric(scheduler: Any) -> bool:
    """Whether a (prepared) schedule steps on a metric instead of per optimizer step."""
    return isinstance(getattr(scheduler, "scheduler", scheduler), ReduceLROnPlateau)


class ScheduleSteps:
    """The loop's event (callbacks.py) that steps the schedule: after each optimizer
    step, or, for one that steps on a metric, after each evaluation with ``monitor``'s
    value (an evaluation without it leaves the schedule as it is)."""

    def __init__(self, scheduler: Any, *, monitor: str) -> None:
        self.scheduler, self.monitor = scheduler, monitor
        self.on_metric = steps_on_metric(scheduler)

    def on_step_end(self, run: Any) -> None:
        if not self.on_metric:
            self.scheduler.step()

    def on_eval_end(self, run: Any, metrics: dict[str, float]) -> None:
        if self.on_metric and self.monitor in metrics:
            self.scheduler.step(metrics[self.monitor])
