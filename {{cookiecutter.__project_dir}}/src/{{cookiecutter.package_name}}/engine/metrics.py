"""Remember the last value of every logged metric and the best monitored one."""

import math
from typing import Any

from .config import ConfigError


class MetricBook:
    def __init__(self, monitor: str, mode: str) -> None:
        self.monitor = monitor
        self.mode = mode
        self.last: dict[str, float] = {}
        self.last_step: dict[str, int] = {}  # the step each metric was last logged at
        self.best_value: float | None = None
        self.best_step: int | None = None

    def update(self, values: dict[str, float], step: int, require_monitor: bool = False) -> bool:
        """Record ``values``; return True when the monitored metric improved.

        With ``require_monitor`` (at evaluations), a monitor that was never
        logged is a configuration error, caught at the first evaluation.
        """
        self.last.update(values)
        self.last_step.update(dict.fromkeys(values, step))
        if require_monitor and self.monitor not in self.last:
            raise ConfigError(
                f"trainer.monitor={self.monitor!r} is not a logged metric; "
                f"available: {', '.join(sorted(self.last))}"
            )
        if self.monitor not in values:
            return False
        value = values[self.monitor]
        if math.isnan(value):
            return False
        better = (
            self.best_value is None
            or (self.mode == "max" and value > self.best_value)
            or (self.mode == "min" and value < self.best_value)
        )
        if better:
            self.best_value, self.best_step = value, step
        return better

    def fresh(self, step: int) -> dict[str, float]:
        """The metrics logged at ``step`` (e.g. for the checkpoint's best rule)."""
        return {k: self.last[k] for k, at in self.last_step.items() if at == step}

    def best(self) -> dict[str, Any]:
        return {"name": self.monitor, "value": self.best_value, "step": self.best_step}

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state, saved in checkpoints."""
        return {
            "last": dict(self.last),
            "last_step": dict(self.last_step),
            "best_value": self.best_value,
            "best_step": self.best_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last = dict(state["last"])
        self.last_step = {k: int(v) for k, v in state["last_step"].items()}
        self.best_value = state["best_value"]
        self.best_step = state["best_step"]
