"""The training state as one object, the loop's optimizer step, and the RNG state.

``TrainState`` is built in train.py and handed (keyword-only) to the checkpoint
manager and preflight: what a checkpoint saves and restores. ``optimizer_step``
is the one step the loop and preflight's timed steps take. docs/checkpoints.md.
"""

import contextlib
import functools
import inspect
import random
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from accelerate.utils import DistributedType

from .. import task
from . import upstream
from .batch_means import loss_and_logs


@dataclass
class Position:
    """Where training continues: optimizer steps done, epoch, and micro-batches
    of that epoch already trained (0: none yet; all of them: the epoch is done)."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


@dataclass
class TrainState:
    """The prepared model, optimizer and scheduler, the loaders, the position (where
    training is: the loop advances it, checkpoints save it, resume sets it), and
    ``stateful`` extras: objects with ``state_dict()``/``load_state_dict()``
    of JSON-able dicts (e.g. the MetricBook), saved in ``trainer_state.json``."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    train_loader: Any
    val_loader: Any
    position: Position = field(default_factory=Position)
    stateful: dict[str, Any] = field(default_factory=dict)

    def advance(self, epoch: int, batch: int) -> int:
        """One optimizer step done, its last micro-batch ``batch`` of ``epoch``: the
        position moves on (the one place it is kept); returns the new step."""
        self.position = Position(self.position.step + 1, epoch, batch)
        return self.position.step


def optimizer_step(
    *,
    accelerator: Any,
    state: TrainState,
    batch: Any,
    agreement: Any,
    clip_norm: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    """One micro-batch: loss (task.py), backward, the NaN guard; when the
    accumulation is complete also clipping, the optimizer step (unless the ranks
    agree to drop it: agreement.on_update) and zero_grad. Returns (loss, the task's
    logs, grad norm or None). A collective under DDP/FSDP: every rank calls it with
    its own batch."""
    model, optimizer = state.model, state.optimizer
    grad_norm = None
    with _accumulation(accelerator, model):
        loss, logs = loss_and_logs(task.loss(model=model, batch=batch))
        accelerator.backward(loss)
        agreement.guard.observe(loss)
        if accelerator.sync_gradients:
            if clip_norm:
                grad_norm = clip_grad_norm(accelerator, model, clip_norm)
            if agreement.on_update():  # on_nan=skip drops a non-finite update
                optimizer.step()
            zero_grad(optimizer)
    return loss, logs, grad_norm


def _accumulation(accelerator: Any, model: torch.nn.Module) -> Any:
    """accelerate's ``accumulate``: per micro-batch it decides ``sync_gradients``
    and enters DDP's ``no_sync`` until the last one. With one micro-batch per
    step every micro-batch syncs (``sync_gradients`` stays True, as accelerate
    starts it), so the context is skipped: ~0.07 ms of a 5.5 ms CPU step of the
    tiny GPT (the template's ``bench/bench.py --only step``)."""
    if accelerator.gradient_accumulation_steps == 1:
        return contextlib.nullcontext()
    return accelerator.accumulate(model)


# Plain setups whose gradients torch's clip_grad_norm_ takes as they are.
_PLAIN_CLIP_SETUPS = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}
_plain_clip: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def clip_grad_norm(accelerator: Any, model: torch.nn.Module, max_norm: float) -> Any:
    """Clip the gradients to ``max_norm``; return the total norm (None: DeepSpeed
    clips inside its engine and reports none before its step).

    accelerate's ``clip_grad_norm_`` dispatches on the setup (FSDP's own, DeepSpeed's,
    XLA's, fp16's unscaling) and in the plain case passes over every parameter
    looking for DTensors before it calls torch's ``clip_grad_norm_``: ~0.07 ms a
    step on the tiny CPU GPT. For one process or DDP, with no grad scaler and no
    DTensor parameter (asked once per model), torch's is called directly: the
    call accelerate ends in. Every other setup goes through accelerate."""
    plain = _plain_clip.get(model)
    if plain is None:
        plain = _plain_clip[model] = (
            accelerator.distributed_type in _PLAIN_CLIP_SETUPS
            and getattr(accelerator, "scaler", None) is None
            and not any(_is_dtensor(p) for p in model.parameters())
        )
    if plain:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return accelerator.clip_grad_norm_(model.parameters(), max_norm)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def zero_grad(optimizer: Any) -> None:
    """``optimizer.zero_grad(set_to_none=True)`` at a step's end. accelerate's plain
    wrapper checks the inner optimizer's signature on every call (``inspect``: ~15 us
    alone, ~0.1 ms of a 10 ms CPU step in the template's ``bench/bench.py --only
    step``); at an optimizer step that is all it does besides the inner call, so the
    inner one is called directly. Its subclasses (DeepSpeed's, whose engine zeroes
    its own buffers) keep their own ``zero_grad``."""
    inner = getattr(optimizer, "optimizer", None)
    plain = upstream.is_plain_accelerated_optimizer(optimizer)
    if plain and _takes_set_to_none(type(inner).zero_grad):
        inner.zero_grad(set_to_none=True)
    else:
        optimizer.zero_grad(set_to_none=True)


@functools.cache
def _takes_set_to_none(function: Any) -> bool:
    return "set_to_none" in inspect.signature(function).parameters


# --- RNG state as tensors and plain containers (so weights_only loading works) -------


def rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {
            "version": version,
            "state": torch.tensor(mt, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
