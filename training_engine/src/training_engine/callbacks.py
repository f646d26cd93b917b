"""Actions at the loop's events, in one visible order (train.py's list): after an
optimizer step, after an evaluation (with its metrics), after a checkpoint save, at
the end of training. The loop's own actions (the EMA, the watchdog, progress, debug,
early stopping) and the owner's callbacks (configs/callbacks/, built from config as
lightning-hydra-template builds them) go through the same list.

A callback implements any of the events (``Callback``'s are no-ops) and receives the
``RunContext``. One with ``state_dict``/``load_state_dict`` is saved in every
checkpoint (``callbacks.<name>`` in trainer_state.json: a JSON-able dict, or a dict
of tensors in ``callbacks.<name>.safetensors``) and restored on resume. Events reach
every rank: a callback that writes files writes them on the main process
(``run.accelerator.is_main_process``), and one that runs a collective (a forward of a
sharded model) runs it on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ConfigError, instantiate


@dataclass
class RunContext:
    """What a callback sees; the loop keeps ``step`` and ``epoch`` current."""

    accelerator: Any
    run_dir: Path
    task: Any
    models: dict[str, Any]
    media: Any = None  # media.Media: images, histograms, texts to every tracker
    total_steps: int = 0
    step: int = 0
    epoch: int = 0
    extras: dict[str, Any] = field(default_factory=dict)  # e.g. the loaders

    @property
    def model(self) -> Any:
        return self.models["model"] if "model" in self.models else next(iter(self.models.values()))


class Callback:
    """Every event a no-op: subclass and implement the ones you need."""

    def on_step_end(self, run: RunContext) -> None:
        """After each optimizer step (``run.step`` is the step just taken)."""

    def on_eval_end(self, run: RunContext, metrics: dict[str, float]) -> None:
        """After each evaluation, with its metrics (every rank has the same)."""

    def on_save(self, run: RunContext, checkpoint: Path) -> None:
        """After a checkpoint was committed (async: when it was handed over)."""

    def on_train_end(self, run: RunContext) -> None:
        """After the loop and the last checkpoint, before the summary."""


EVENTS = ("on_step_end", "on_eval_end", "on_save", "on_train_end")


class Callbacks:
    """The ordered list the loop calls; each event calls only those that implement it."""

    def __init__(self, items: list[Any]) -> None:
        self.items = [item for item in items if item is not None]
        self._by_event = {
            event: [getattr(item, event) for item in self.items if hasattr(item, event)]
            for event in EVENTS
        }

    def on_step_end(self, run: RunContext) -> None:
        for call in self._by_event["on_step_end"]:
            call(run)

    def on_eval_end(self, run: RunContext, metrics: dict[str, float]) -> None:
        for call in self._by_event["on_eval_end"]:
            call(run, metrics)

    def on_save(self, run: RunContext, checkpoint: Path) -> None:
        for call in self._by_event["on_save"]:
            call(run, checkpoint)

    def on_train_end(self, run: RunContext) -> None:
        for call in self._by_event["on_train_end"]:
            call(run)


def build_callbacks(section: Any) -> dict[str, Any]:
    """The ``callbacks`` config section (name -> ``_target_`` node; null: none) built
    in its order. A callback must implement at least one event."""
    built: dict[str, Any] = {}
    for name, node in (section or {}).items():
        if node is None:  # callbacks.NAME=null switches one off
            continue
        callback = instantiate(node, what=f"callbacks.{name}")
        if not any(callable(getattr(callback, event, None)) for event in EVENTS):
            raise ConfigError(
                f"callbacks.{name}: {type(callback).__qualname__} implements none of "
                + ", ".join(EVENTS)
                + " (subclass engine.callbacks.Callback)"
            )
        built[str(name)] = callback
    return built


def stateful(callbacks: dict[str, Any]) -> dict[str, Any]:
    """The callbacks with state, as TrainState.stateful entries: ``callbacks.<name>``."""
    return {
        f"callbacks.{name}": cb
        for name, cb in callbacks.items()
        if callable(getattr(cb, "state_dict", None))
        and callable(getattr(cb, "load_state_dict", None))
    }
