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


def rng_problem(state: Any) -> str | None:
    """Why ``state`` is not an RNG state as ``rng_state`` writes it (asked before
    ``set_rng_state``: a forged one is refused, never applied); None if it is."""
    if not isinstance(state, dict):
        return "not an RNG state (python, numpy and torch's)"
    py, npy = state.get("python"), state.get("numpy")
    if not (
        isinstance(py, dict) and _words(py.get("state"), 625) and isinstance(py.get("version"), int)
    ):
        return "python: not the Mersenne Twister's 625 words"
    if not (
        isinstance(npy, dict) and _words(npy.get("keys"), 624) and npy.get("pos") in range(625)
    ):
        return "numpy: not the Mersenne Twister's 624 keys and a position"
    size = torch.get_rng_state().numel()
    cpu = state.get("torch")
    if not (_tensor(cpu, torch.uint8) and cpu.shape == (size,)):
        found = list(cpu.shape) if isinstance(cpu, torch.Tensor) else type(cpu).__name__
        return f"torch: {found}, not the CPU generator's state of {size} bytes"
    cuda = state.get("cuda", [])
    small = isinstance(cuda, list | tuple) and len(cuda) <= 4096
    if not (small and all(_tensor(t, torch.uint8) and t.numel() <= 4096 for t in cuda)):
        return "cuda: not the GPUs' generator states"
    return None


def _tensor(value: Any, dtype: torch.dtype) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == dtype and value.ndim == 1


def _words(value: Any, count: int) -> bool:
    return _tensor(value, torch.int64) and value.numel() == count
