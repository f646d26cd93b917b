"""New inputs for predict.py (``files=...``): the command line's files, folders and
globs, read by the data option's own reader with the run's preprocessing.

The interface: a data function may carry a ``files`` attribute (like
``resume_may_change``), a function ``(paths, data)`` of the given paths (files or
folders, globs expanded) and the run's data config, returning a dataset of
``(input, -1)`` samples whose ``paths`` list names each sample's file, in order.
``data.images.images.files`` is one.
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from typing import Any

from hydra.utils import get_method
from omegaconf import DictConfig, ListConfig

from .config import ConfigError

GLOB_CHARS = set("*?[")


def expand(files: Any) -> list[str]:
    """A path, a glob or a list of them, as paths (globs expanded, sorted)."""
    given = list(files) if isinstance(files, list | tuple | ListConfig) else [files]
    paths: list[str] = []
    for entry in given:
        if not isinstance(entry, str) or not entry:
            raise ConfigError(f"files={files!r} is not allowed: expected a path, a glob or a list")
        matched = sorted(glob.glob(entry)) if GLOB_CHARS & set(entry) else [entry]
        if not matched:
            raise ConfigError(f"files={entry!r} is not allowed: the glob matches nothing")
        paths.extend(matched)
    return paths


def read_files(data: DictConfig, files: Any) -> Any:
    """The dataset of ``files`` for the run's data option, or a ConfigError (exit 2)
    when that option has no reader or the reader returns no ``paths``."""
    target = data.get("_target_")
    reader = getattr(get_method(target), "files", None) if isinstance(target, str) else None
    if not callable(reader):
        raise ConfigError(
            f"files=... is not allowed with the run's data ({target}): its function has no "
            "`files` reader; expected a run trained on a data option that reads files "
            "(data=images), or split=val|train|test"
        )
    dataset = reader(expand(files), data)
    paths = getattr(dataset, "paths", None)
    if not isinstance(paths, Sequence) or len(paths) != len(dataset):
        raise ConfigError(
            f"{target}.files returned {type(dataset).__name__} without a `paths` list of its "
            "samples' files; expected one path per sample, in order"
        )
    return dataset
