"""Remember the last value of every logged metric and the best monitored one
(``MetricBook``), and average the training loss and the task's logs over a log
window (``WindowMeans``)."""

import math
from typing import Any

import torch

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


class WindowMeans:
    """train/loss and the task's logs (task.loss's second value), summed on the device
    per micro-batch (no host sync) and averaged over a log window across the ranks:
    one all-reduce per log step, the loss's and the logs' together."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self._names: list[str] = []
        self._sums: torch.Tensor | None = None
        self._count = 0

    def add(self, loss: torch.Tensor, logs: dict[str, torch.Tensor]) -> None:
        values = [loss.detach().float().reshape(())]
        values += [torch.as_tensor(v).detach().float().reshape(()) for v in logs.values()]
        stacked = torch.stack(values).to(self.accelerator.device)
        if self._sums is None:
            self._names, self._sums = ["loss", *logs], torch.zeros_like(stacked)
        self._sums += stacked
        self._count += 1

    def means(self) -> dict[str, float]:
        """The window's means, ``train/<name>``, then a new window. A collective:
        every rank calls it at the same log step."""
        if self._sums is None or not self._count:
            return {}
        total = self.accelerator.reduce(self._sums, "mean").tolist()
        means = {
            f"train/{name}": value / self._count
            for name, value in zip(self._names, total, strict=True)
        }
        self._sums.zero_()
        self._count = 0
        return means
