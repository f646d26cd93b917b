"""Experiment trackers, built from ``cfg.tracker`` for accelerate's tracker API.

``cfg.tracker`` maps each selected tracker to its settings; Hydra's
multi-select (``tracker=[csv,...]``) merges the options. accelerate's
``init_trackers``/``log``/``end_training`` run on the main process only, so no
other rank ever opens a tracker file.
"""

import csv
import time
from pathlib import Path
from typing import Any

from accelerate.tracking import GeneralTracker
from omegaconf import DictConfig

from .config_checks import ConfigError

AVAILABLE = ("csv",)


class CSVTracker(GeneralTracker):
    """Append metrics to ``metrics.csv`` in the run dir, one row per value:
    ``time,step,name,value`` (long format: new metric names never rewrite the
    file, and a resumed run appends to it)."""

    name = "csv"
    requires_logging_directory = False

    def __init__(self, run_dir: str | Path, filename: str = "metrics.csv") -> None:
        super().__init__()
        self.path = Path(run_dir) / filename
        self._file = None
        self._writer = None

    @property
    def tracker(self):
        return self._writer

    def start(self) -> None:
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(["time", "step", "name", "value"])

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        now = f"{time.time():.3f}"
        for key, value in values.items():
            self._writer.writerow([now, step, key, value])
        self._file.flush()

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def build_trackers(tracker_cfg: DictConfig, run_dir: Path) -> list[GeneralTracker]:
    """Tracker objects for ``Accelerator(log_with=...)``; an empty list for none."""
    trackers: list[GeneralTracker] = []
    for name, settings in tracker_cfg.items():
        if name == "csv":
            trackers.append(CSVTracker(run_dir, **settings))
        else:
            raise ConfigError(
                f"tracker={name!r} is not available; choose from: none, {', '.join(AVAILABLE)}"
            )
    return trackers


def flatten_config(tree: Any, prefix: str = "") -> dict[str, str | int | float | bool]:
    """Nested config -> ``{"a/b/c": scalar}`` for hyperparameter logging;
    lists and None become strings, which every tracker accepts."""
    if isinstance(tree, dict):
        flat: dict[str, str | int | float | bool] = {}
        for key, value in tree.items():
            flat.update(flatten_config(value, f"{prefix}{key}/"))
        return flat
    key = prefix.rstrip("/")
    if isinstance(tree, bool | int | float | str):
        return {key: tree}
    return {key: str(tree)}
