"""What the engine may call on the owner's task: the interface (``Task``), a base with
the defaults (``TaskDefaults``), and the check that a configured task has them
(``check_task``). The engine never imports the owner's task: train.py, eval.py,
predict.py and generate.py build it from ``cfg.task`` and hand it over.

A task says what a batch is (``inputs``, ``batch_size``), what the model's output
means (``logits``), the loss of a micro-batch and its logs (``loss``), the training
step (``training_step``: backward, clipping and the update through the engine's
``Step``), the evaluation (``evaluate``), what a prediction is (``predict``), how the
optimizer groups the parameters (``param_groups``) and which metrics its evaluation
returns (``metrics``). docs/own-model.md shows one.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from .batch_means import average_over_batches, loss_and_logs
from .config import ConfigError, instantiate
from .param_groups import decay_groups

# What every task has; ``check_task`` names the ones a configured task lacks (training
# needs all but ``predict``, which predict.py needs).
REQUIRED = (
    "metrics",
    "inputs",
    "batch_size",
    "logits",
    "loss",
    "training_step",
    "evaluate",
    "predict",
    "param_groups",
)


@runtime_checkable
class Task(Protocol):
    """The engine's side of a task (keyword-only arguments throughout)."""

    metrics: tuple[str, ...]  # what ``evaluate`` returns: val/<name>; trainer.monitor picks one

    def inputs(self, *, batch: Any) -> Any:
        """What the model is called with."""

    def batch_size(self, *, batch: Any) -> tuple[int, int | None]:
        """(samples, tokens) in a batch; tokens None for a task without positions."""

    def logits(self, output: Any) -> torch.Tensor:
        """The model's output as logits (generate.py samples from the last position)."""

    def loss(
        self, *, model: torch.nn.Module, batch: Any
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's objective, and what to log beside it (train/<name>)."""

    def training_step(self, *, step: Any, batch: Any) -> tuple[torch.Tensor, dict]:
        """One micro-batch of training through ``step`` (engine.step.Step): the loss,
        backward, and at the accumulation's end clipping and the update."""

    def evaluate(self, *, model: torch.nn.Module, loader: Any, accelerator: Any) -> dict:
        """``metrics`` over a whole split, the same on any number of processes."""

    def predict(self, *, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """predict.py's columns for one batch, one value (or row) per sample."""

    def param_groups(self, model: torch.nn.Module) -> Any:
        """The optimizer's parameter groups."""


class TaskDefaults:
    """The defaults a task may keep: the training step written out, an evaluation that
    averages ``loss`` and its logs over every sample (token), the standard weight-decay
    groups. A subclass gives ``metrics``, ``inputs``, ``batch_size``, ``logits`` and
    ``loss``, and ``predict`` for predict.py."""

    def training_step(self, *, step: Any, batch: Any) -> tuple[torch.Tensor, dict]:
        """The default step: forward and loss, backward (the NaN guard sees the loss);
        when the accumulation is complete, clipping, the update (dropped when the ranks
        agree the loss was not finite) and zero_grad. Override it for two optimizers, a
        GAN's alternating updates or per-group clipping: ``step`` has the verbs."""
        with step.accumulate():
            loss, logs = loss_and_logs(self.loss(model=step.model, batch=batch))
            step.backward(loss)
            if step.sync_gradients:
                step.clip_gradients()
                step.update()
        return loss, logs

    def evaluate(self, *, model: torch.nn.Module, loader: Any, accelerator: Any) -> dict:
        """``val/loss`` and ``val/<log>`` for each of ``loss``'s logs, weighted by the
        batch's tokens (or samples). A collective: call on every rank."""

        def weight(batch: Any) -> int:
            samples, tokens = self.batch_size(batch=batch)
            return tokens or samples

        model.eval()
        try:
            means = average_over_batches(
                lambda b: self.loss(model=model, batch=b), loader, accelerator, weight
            )
        finally:
            model.train()
        return {f"val/{name}": value for name, value in means.items()}

    def param_groups(self, model: torch.nn.Module) -> Any:
        """No weight decay on biases, norms and embeddings (param_groups.py)."""
        return decay_groups(model)


def check_task(task: Any, *, where: str = "task", predicts: bool = False) -> Task:
    """``task`` itself when it has every method and attribute the engine calls (also
    ``predict`` when it ``predicts``); else a ConfigError (exit 2, before any work)
    naming what is missing."""
    needed = [name for name in REQUIRED if predicts or name != "predict"]
    missing = [name for name in needed if not hasattr(task, name)]
    methods = [name for name in needed if name != "metrics" and name not in missing]
    problems = [f"has no {name}" for name in missing]
    problems += [f"{name} is not a method" for name in methods if not callable(getattr(task, name))]
    metrics = getattr(task, "metrics", ())
    if "metrics" not in missing and not (
        isinstance(metrics, tuple | list) and all(isinstance(m, str) for m in metrics)
    ):
        problems.append(f"metrics={metrics!r} is not a tuple of metric names")
    if problems:
        raise ConfigError(
            f"{where}: {type(task).__module__}.{type(task).__qualname__} is not a task: "
            + "; ".join(problems)
            + " (training_engine.task's Task lists what a task has; TaskDefaults has the defaults)"
        )
    return task


def build_task(node: Any, *, predicts: bool = False) -> Task:
    """The task of the config section ``task`` (its ``_target_``), checked."""
    return check_task(instantiate(node, what="task"), where="task", predicts=predicts)
