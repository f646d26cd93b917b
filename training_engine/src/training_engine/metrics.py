"""The metrics a run has logged (``MetricBook``): the last value of each and every
"best" the run keeps, one place that decides them: ``trainer.monitor``'s (the value
train.py returns to a sweeper), ``checkpoint.save_best.monitor``'s (checkpoint/policy.py
asks it which step was a new best) and early stopping's (early_stopping.py asks it,
with its ``min_delta``). And the training loss and the task's logs averaged over a
log window (``WindowMeans``)."""

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .config import ConfigError


@dataclass
class Best:
    """The best value of ``name`` so far (``mode``: min or max), improved only by more
    than ``min_delta``; NaN never improves it."""

    name: str
    mode: str
    min_delta: float = 0.0
    value: float | None = None
    step: int | None = None

    def offer(self, value: float, step: int) -> bool:
        if math.isnan(value):
            return False
        if self.value is not None:
            margin = value - self.value if self.mode == "max" else self.value - value
            if margin <= self.min_delta:
                return False
        self.value, self.step = value, step
        return True


class MetricBook:
    def __init__(self, monitor: str, mode: str) -> None:
        self.monitor = monitor
        self.mode = mode
        self.last: dict[str, float] = {}
        self.last_step: dict[str, int] = {}  # the step each metric was last logged at
        self._bests: dict[tuple[str, str, float], Best] = {}
        self.watch(monitor, mode)

    def watch(self, name: str, mode: str, min_delta: float = 0.0) -> Best:
        """Keep the best of ``name`` (from now on; a resumed book has it already)."""
        key = (name, mode, float(min_delta))
        if key not in self._bests:
            self._bests[key] = Best(name, mode, float(min_delta))
        return self._bests[key]

    def update(self, values: dict[str, float], step: int, require_monitor: bool = False) -> bool:
        """Record ``values`` and every best they improve; True when trainer.monitor's did.

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
        improved = {
            key: best.offer(values[best.name], step)
            for key, best in self._bests.items()
            if best.name in values
        }
        return improved.get((self.monitor, self.mode, 0.0), False)

    def new_best_at(self, step: int, name: str, mode: str, min_delta: float = 0.0) -> bool:
        """Whether ``name``'s value logged at ``step`` was a new best (watched)."""
        return self.watch(name, mode, min_delta).step == step and self.last_step.get(name) == step

    def best_of(self, name: str, mode: str, min_delta: float = 0.0) -> Best:
        return self.watch(name, mode, min_delta)

    @property
    def best_value(self) -> float | None:
        return self.best_of(self.monitor, self.mode).value

    @property
    def best_step(self) -> int | None:
        return self.best_of(self.monitor, self.mode).step

    def fresh(self, step: int) -> dict[str, float]:
        """The metrics logged at ``step``."""
        return {k: self.last[k] for k, at in self.last_step.items() if at == step}

    def best(self) -> dict[str, Any]:
        return {"name": self.monitor, "value": self.best_value, "step": self.best_step}

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state, saved in checkpoints."""
        return {
            "last": dict(self.last),
            "last_step": dict(self.last_step),
            "bests": [asdict(best) for best in self._bests.values()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last = dict(state["last"])
        self.last_step = {k: int(v) for k, v in state["last_step"].items()}
        for saved in state.get("bests", []):
            best = self.watch(saved["name"], saved["mode"], saved["min_delta"])
            best.value, best.step = saved["value"], saved["step"]


class WindowMeans:
    """train/loss and the task's logs (task.loss's second value), summed on the device
    per micro-batch (no host sync) and averaged over a log window across the ranks:
    one all-reduce per log step, the loss's and the logs' together. A checkpoint keeps
    every rank's sums of the window it cuts, so a resumed run logs the window's means
    as an uninterrupted one does (``state_dict``: a collective, at a save)."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self._names: list[str] = []
        self._sums: list[torch.Tensor] = []  # one float32 0-dim running sum per name
        self._count = 0

    def add(self, loss: torch.Tensor, logs: dict[str, torch.Tensor]) -> None:
        """One micro-batch's values, each added in place to its float32 sum (an op per
        value; a stack and a copy per step cost ~15 us more of a CPU step, and two
        kernel launches on a GPU). The same float32 sums, bit for bit, as adding each
        value cast to float32."""
        if not self._sums:
            self._names = ["loss", *logs]
            device = self.accelerator.device
            self._sums = [torch.zeros((), dtype=torch.float32, device=device) for _ in self._names]
        values = [loss, *logs.values()]
        if len(values) != len(self._sums):
            raise ValueError(f"the task's logs changed: {list(logs)}, before {self._names[1:]}")
        for total, value in zip(self._sums, values, strict=True):
            value = value.detach() if torch.is_tensor(value) else torch.as_tensor(value)
            if value.dtype == torch.float64:  # rounded first (the others: exact in float32)
                value = value.float()
            total.add_(value if value.dim() == 0 else value.reshape(()))
        self._count += 1

    @property
    def sums(self) -> torch.Tensor | None:
        """This rank's sums of the open window (None: empty), for a collective to carry."""
        return torch.stack(self._sums) if self._count else None

    def means(self, averaged: torch.Tensor | None = None) -> dict[str, float]:
        """The window's means, ``train/<name>``, then a new window. ``averaged``: the
        sums already averaged over the ranks (carried by the agreement's collective);
        without it, a collective: every rank calls it at the same log step."""
        if not self._count:
            return {}
        if averaged is None:
            averaged = self.accelerator.reduce(torch.stack(self._sums), "mean")
        total = averaged.tolist()
        means = {
            f"train/{name}": value / self._count
            for name, value in zip(self._names, total, strict=True)
        }
        for running in self._sums:
            running.zero_()
        self._count = 0
        return means

    def state_dict(self) -> dict[str, Any]:
        """The open window: its names, count and every rank's sums (a collective while
        a window is open: every rank saves at the same step, with the same count)."""
        if not self._count:
            return {"names": self._names, "count": 0, "sums": []}
        sums = self.accelerator.gather(torch.stack(self._sums).reshape(1, -1)).cpu().tolist()
        return {"names": self._names, "count": self._count, "sums": sums}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's sums (a checkpoint of another world size: one saved rank's)."""
        sums = state.get("sums") or []
        if not state.get("count") or not sums:
            return
        rank = self.accelerator.process_index % len(sums)
        self._names, self._count = list(state["names"]), int(state["count"])
        device = self.accelerator.device
        self._sums = [torch.tensor(v, dtype=torch.float32, device=device) for v in sums[rank]]
