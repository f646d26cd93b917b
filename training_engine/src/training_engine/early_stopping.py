"""Early stopping (``trainer.early_stopping``): stop when ``trainer.monitor`` has
not improved by more than ``min_delta`` for ``patience`` evaluations. A stateful
extra: the count of evaluations without improvement is saved in checkpoints, so
a resumed run keeps it. Every rank sees the same evaluation (task.evaluate sums
across ranks), so every rank decides the same without a collective.
docs/lifecycle.md.
"""

from __future__ import annotations

import logging
from typing import Any

from . import schema

log = logging.getLogger(__name__)


class EarlyStopping:
    """``patience=None``: off (``observe`` never stops, nothing in summary.json).
    Whether an evaluation improved it asks the run's MetricBook (``book``), which
    keeps the monitor's best improved by more than ``min_delta``."""

    def __init__(
        self,
        *,
        patience: int | None = schema.EarlyStopping.patience,
        min_delta: float = schema.EarlyStopping.min_delta,
        monitor: str,
        mode: str,
        book: Any,
    ) -> None:
        schema.EarlyStopping(patience=patience, min_delta=min_delta)  # its checks: ConfigError
        self.patience, self.min_delta = patience, float(min_delta)
        self.monitor, self.mode = monitor, mode
        self.book = book
        if patience is not None:
            book.watch(monitor, mode, self.min_delta)
        self.bad_evaluations = 0
        self.stopped_step: int | None = None
        self.reason: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stopped_step is not None

    @property
    def best(self) -> float | None:
        return self.book.best_of(self.monitor, self.mode, self.min_delta).value

    def on_eval_end(self, run: Any, metrics: dict[str, float]) -> None:
        """The loop's event (callbacks.py): the patience runs on after an evaluation."""
        self.observe(run.step)

    def observe(self, step: int) -> bool:
        """After an evaluation at ``step`` (its metrics in the book): True when training
        should stop now."""
        logged = self.book.last_step.get(self.monitor) == step
        if self.patience is None or self.stopped or not logged:
            return self.stopped
        if self.book.new_best_at(step, self.monitor, self.mode, self.min_delta):
            self.bad_evaluations = 0
        else:
            self.bad_evaluations += 1
        if self.bad_evaluations >= self.patience:
            self.stopped_step = step
            self.reason = (
                f"{self.monitor} did not improve by more than {self.min_delta:g} in "
                f"{self.patience} evaluations (best {self.best:.6g})"
            )
            log.info(f"early stopping at step {step}: {self.reason}")
        return self.stopped

    def summary(self) -> dict[str, Any]:
        """For summary.json: empty when off."""
        if self.patience is None:
            return {}
        return {
            "early_stopping": {
                "stopped": self.stopped,
                "step": self.stopped_step,
                "reason": self.reason,
                "bad_evaluations": self.bad_evaluations,
            }
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "bad_evaluations": self.bad_evaluations,
            "stopped_step": self.stopped_step,
            "reason": self.reason,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bad_evaluations = int(state["bad_evaluations"])
        self.stopped_step = state["stopped_step"]
        self.reason = state["reason"]
