"""A classification's class names: the training set's ``classes`` (torchvision's
``ImageFolder`` convention; ``data=images``), checked against the model's outputs
before any work (exit 2, naming both counts, instead of an ``IndexError`` in the
first step), and kept in the run dir (``classes.json``) so that predict.py and
``load_model`` name the classes a checkpoint predicts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

from .config import ConfigError
from .files import write_json_atomic
from .trust import Malformed, read_json

log = logging.getLogger(__name__)

FILE = "classes.json"
MAX_CLASSES = 1_000_000


def data_classes(loaders: Any) -> list[str] | None:
    """The training set's class names, when it has a ``classes`` list of strings."""
    train = getattr(loaders, "train", None)
    classes = getattr(getattr(train, "dataset", None), "classes", None)
    if isinstance(classes, list | tuple) and classes and all(isinstance(c, str) for c in classes):
        return list(classes)
    return None


def model_outputs(model: nn.Module) -> int | None:
    """How many classes the model scores: its ``num_classes`` (timm, the examples),
    ``config.num_labels`` (transformers) or its last ``nn.Linear``'s outputs."""
    for value in (
        getattr(model, "num_classes", None),
        getattr(getattr(model, "config", None), "num_labels", None),
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1].out_features if linears else None


def check_model_fits_classes(model: nn.Module, classes: list[str] | None) -> None:
    outputs = model_outputs(model)
    if classes is None or outputs is None or outputs == len(classes):
        return
    shown = ", ".join(classes[:10]) + (", ..." if len(classes) > 10 else "")
    raise ConfigError(
        f"the model scores {outputs} classes, but the training data has {len(classes)} "
        f"({shown}): expected model.num_classes={len(classes)} (its YAML: "
        "num_classes: N), or data whose class folders match the model"
    )


def write_classes(run_dir: Path, classes: list[str] | None) -> None:
    if classes is not None:
        write_json_atomic(Path(run_dir) / FILE, classes)


def read_classes(run_dir: Path) -> list[str] | None:
    """The run's class names; None when it has none, or when the file is not a
    list of strings (then with a warning: it is data from a run dir)."""
    path = Path(run_dir) / FILE
    if not path.exists():
        return None
    try:
        classes = read_json(path, max_bytes=64 * 2**20)
    except Malformed as err:
        log.warning(f"{err}; predicting class indices without names")
        return None
    if not (
        isinstance(classes, list)
        and len(classes) <= MAX_CLASSES
        and all(isinstance(c, str) for c in classes)
    ):
        log.warning(f"{path}: not a list of class names; predicting class indices without names")
        return None
    return classes


def run_dir_of(checkpoint: Path) -> Path:
    """The run dir of a ``step_*`` checkpoint (``<run>/checkpoints/step_*``)."""
    checkpoint = Path(checkpoint)
    return (
        checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    )
