"""An exponential moving average of the weights (``trainer.ema``): updated after
every optimizer step, evaluated as ``val_ema/*`` by the task, saved in every
checkpoint as ``ema.safetensors`` (a stateful extra whose state is tensors) and
restored bit-exactly; eval.py/predict.py/load_model pick it with ``weights=ema``.

The average is torch's own ``AveragedModel`` with its EMA update (a well-kept
implementation: foreach lerp over parameters and buffers). Under DDP every rank
holds the same parameters, so every rank keeps the same average without a
collective. Under FSDP/DeepSpeed the parameters are sharded: refused (below).
docs/lifecycle.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from .checkpoint.full_state import plain_model
from .config import ConfigError
from .schema import section


class WeightAverage:
    """``enabled=false``: every verb is a no-op and nothing is saved."""

    def __init__(self, settings: Any, *, model: Any, accelerator: Any) -> None:
        """``settings``: the ``trainer.ema`` group (enabled, decay)."""
        settings = section("trainer.ema", settings)
        enabled, decay = settings.enabled, settings.decay
        self.enabled = enabled
        self.averaged: AveragedModel | None = None
        if not enabled:
            return
        mode = accelerator.distributed_type.value
        if mode in ("FSDP", "DEEPSPEED"):
            raise ConfigError(
                f"trainer.ema.enabled=true is not supported with {mode}: its parameters are "
                "sharded across ranks, and the average would be of one shard. Use parallel=ddp "
                "(or none) with EMA, or trainer.ema.enabled=false"
            )
        self._accelerator = accelerator
        self.averaged = AveragedModel(
            self._plain(model), multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True
        )

    def _plain(self, model: torch.nn.Module) -> torch.nn.Module:
        return plain_model(self._accelerator, model)

    @property
    def stateful(self) -> dict[str, WeightAverage]:
        """For TrainState.stateful: saved in checkpoints only when enabled."""
        return {"ema": self} if self.enabled else {}

    def on_step_end(self, run: Any) -> None:
        """The loop's event (callbacks.py): average the weights of the step just taken."""
        self.update(run.model)

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """After an optimizer step (the first one copies the weights)."""
        if self.averaged is not None:
            self.averaged.update_parameters(self._plain(model))

    def evaluate(self, *, task: Any, loader: Any, accelerator: Any) -> dict[str, float]:
        """``task.evaluate`` of the average, named ``val_ema/*``; a collective like it."""
        if self.averaged is None:
            return {}
        metrics = task.evaluate(model=self.averaged.module, loader=loader, accelerator=accelerator)
        return {"val_ema/" + name.split("/", 1)[1]: value for name, value in metrics.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors: ``module.<parameter name>`` and ``n_averaged`` (AveragedModel's)."""
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.averaged.load_state_dict(state)


def metric_names(ema: Any, metrics: tuple[str, ...]) -> tuple[str, ...]:
    """The metrics ``evaluate`` logs for the config section ``trainer.ema``, of a task
    whose evaluation returns ``metrics``."""
    if not ema.enabled:
        return ()
    return tuple("val_ema/" + name.split("/", 1)[1] for name in metrics)
