"""The training state as one object, and the RNG state.

``TrainState`` is built in train.py and handed (keyword-only) to the checkpoint
manager and preflight: what a checkpoint saves and restores, the task whose step
trains it and the ``Step`` whose verbs that step takes (step.py). docs/checkpoints.md.
"""

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


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
    of JSON-able dicts (e.g. the MetricBook), saved in ``trainer_state.json``. The
    ``task`` and the ``step`` (its verbs) are not saved: preflight's timed steps take
    the same ``task.training_step`` as the loop."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    train_loader: Any
    val_loader: Any
    task: Any = None
    step: Any = None
    position: Position = field(default_factory=Position)
    stateful: dict[str, Any] = field(default_factory=dict)

    def advance(self, epoch: int, batch: int) -> int:
        """One optimizer step done, its last micro-batch ``batch`` of ``epoch``: the
        position moves on (the one place it is kept); returns the new step."""
        self.position = Position(self.position.step + 1, epoch, batch)
        return self.position.step


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
