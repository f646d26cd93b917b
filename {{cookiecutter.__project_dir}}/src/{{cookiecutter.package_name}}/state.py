"""The training state as one object, the loop's optimizer step, and the RNG state.

``TrainState`` is built in train.py and handed (keyword-only) to the checkpoint
manager and preflight: what a checkpoint saves and restores. ``optimizer_step``
is the one step the loop and preflight's timed steps take. README: "Checkpoints and resuming".
"""

import functools
import inspect
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from accelerate.optimizer import AcceleratedOptimizer

from . import task


@dataclass
class Position:
    """Where training continues: optimizer steps done, epoch, and micro-batches
    of that epoch already trained (0: none yet; all of them: the epoch is done)."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


@dataclass
class TrainState:
    """The prepared model, optimizer and scheduler, the loaders, the position,
    and ``stateful`` extras: objects with ``state_dict()``/``load_state_dict()``
    of JSON-able dicts (e.g. the MetricBook), saved in ``trainer_state.json``."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    train_loader: Any
    val_loader: Any
    position: Position = field(default_factory=Position)
    stateful: dict[str, Any] = field(default_factory=dict)


def optimizer_step(
    *,
    accelerator: Any,
    state: TrainState,
    batch: Any,
    guard: Any,
    clip_norm: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One micro-batch: loss (task.py), backward, the NaN guard; when the
    accumulation is complete also clipping, the optimizer step (unless the guard
    drops it) and zero_grad. Returns (loss, grad norm or None). A collective
    under DDP/FSDP: every rank calls it with its own batch."""
    model, optimizer = state.model, state.optimizer
    grad_norm = None
    with accelerator.accumulate(model):
        loss = task.loss(model=model, batch=batch)
        accelerator.backward(loss)
        guard.observe(loss)
        if accelerator.sync_gradients:
            if clip_norm:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_norm)
            if guard.agree_on_update():  # on_nan=skip drops a non-finite update
                optimizer.step()
            zero_grad(optimizer)
    return loss, grad_norm


def zero_grad(optimizer: Any) -> None:
    """``optimizer.zero_grad(set_to_none=True)`` at a step's end. accelerate's plain
    wrapper checks the inner optimizer's signature on every call (``inspect``:
    ~15 us alone, ~0.1 ms of a 10 ms CPU step in ``bench.py --only step``); at an
    optimizer step that is all it does besides the inner call, so the inner one
    is called directly. Its subclasses (DeepSpeed's, whose engine zeroes its own
    buffers) keep their own ``zero_grad``."""
    inner = getattr(optimizer, "optimizer", None)
    if type(optimizer) is AcceleratedOptimizer and _takes_set_to_none(type(inner).zero_grad):
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
