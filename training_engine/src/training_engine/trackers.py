"""The tracker classes for accelerate's tracker API: CSV (metrics.csv), TensorBoard,
W&B and MLflow, each offline by default and continuing its run after a resume (the
run ids come from the checkpoints). Optional packages are imported when a tracker
starts. Which trackers a run gets is tracking.py's. docs/trackers.md.
"""

import contextlib
import csv
import io
import logging
import netrc
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from accelerate.tracking import GeneralTracker, on_main_process
from accelerate.tracking import MLflowTracker as AccelerateMLflowTracker
from accelerate.tracking import TensorBoardTracker as AccelerateTensorBoardTracker
from accelerate.tracking import WandBTracker as AccelerateWandBTracker

from .files import locked, write_atomic

log = logging.getLogger(__name__)


class CSVTracker(GeneralTracker):
    """Append metrics to ``metrics.csv`` in the run dir, one row per value:
    ``time,step,name,value`` (long format: new metric names never rewrite the
    file, and a resumed run appends to it, dropping first the rows the interrupted
    run logged after the checkpoint it resumes from, as TensorBoard's purge does)."""

    name = "csv"
    requires_logging_directory = False

    def __init__(self, run_dir: str | Path, filename: str = "metrics.csv") -> None:
        super().__init__()
        self.path = Path(run_dir) / filename
        self.resumed_step: int | None = None
        self._file = None
        self._writer = None

    def continue_from(self, step: int, run_id: str | None) -> None:
        self.resumed_step = step

    @property
    def tracker(self):
        return self._writer

    def start(self) -> None:
        if self.resumed_step is not None and self.path.is_file():
            self._drop_rows_after(self.resumed_step)
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

    def _drop_rows_after(self, step: int) -> None:
        """Rewrite the file without the rows of later steps (atomically: old or new)."""
        with open(self.path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
        kept = [r for r in rows if len(r) < 2 or not r[1].isdigit() or int(r[1]) <= step]
        if len(kept) < len(rows):
            buffer = io.StringIO()
            csv.writer(buffer).writerows(kept)
            write_atomic(self.path, buffer.getvalue())


class TensorBoardTracker(AccelerateTensorBoardTracker):
    """accelerate's TensorBoard tracker, writing to ``<run dir>/tensorboard``.

    The config goes into the run's own event file as hparams, with
    ``hparam_metrics`` as the metric columns, so TensorBoard's HParams tab lines
    up the runs of a sweep (accelerate writes hparams as a separate,
    timestamped run). A resumed run hides what the interrupted run logged after
    the checkpoint it resumes from (SummaryWriter's purge_step)."""

    main_process_only = True

    def __init__(self, run_dir: Path, hparam_metrics: list[str] | None = None) -> None:
        super().__init__("tensorboard", str(run_dir))
        self.hparam_metrics = list(hparam_metrics or [])

    def continue_from(self, step: int, run_id: str | None) -> None:
        self.init_kwargs["purge_step"] = step + 1  # SummaryWriter's keyword, at start()

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(values, dict.fromkeys(self.hparam_metrics, 0.0)):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()


class WandBTracker(AccelerateWandBTracker):
    """accelerate's W&B tracker: offline unless ``mode``, ``WANDB_MODE`` or an
    API key says otherwise (no key never fails), files and cache in
    ``<run dir>/wandb``, error reporting off, and resumable by run id
    (``resume="allow"``; train.py logs with explicit steps, so they continue)."""

    main_process_only = True

    def __init__(
        self,
        project: str,
        run_dir: Path,
        mode: str | None = None,
        watch: dict | None = None,
        **init_kwargs: Any,  # entity, group, tags, ...: passed to wandb.init
    ) -> None:
        super().__init__(project, **init_kwargs)
        self.run_dir = Path(run_dir)
        self.run_id: str | None = None  # to resume; after start, this run's id (saved)
        self.mode = mode
        self.watch_settings = watch or {}

    def continue_from(self, step: int, run_id: str | None) -> None:
        self.run_id = run_id  # W&B continues the run; train.py logs with explicit steps

    @on_main_process
    def start(self) -> None:
        self.init_kwargs.update(
            dir=str(self.run_dir),
            mode=self.mode or _wandb_default_mode(),
            id=self.run_id,  # None: a new run
            resume="allow",
        )
        # Read by the W&B service process wandb.init starts; restored right after,
        # so the next job of a multirun (same process) sets its own.
        env = {
            "WANDB_CACHE_DIR": str(self.run_dir / "wandb" / "cache"),
            "WANDB_ERROR_REPORTING": "false",
        }
        with _environ({k: v for k, v in env.items() if k not in os.environ}):
            super().start()
        self.run_id = self.run.id

    @on_main_process
    def finish(self) -> None:
        import wandb

        super().finish()
        wandb.teardown()  # the service ends too: a next job starts its own (its cache dir)


def _wandb_default_mode() -> str | None:
    """None (wandb reads ``WANDB_MODE``) when set, else online only with a key."""
    if os.environ.get("WANDB_MODE"):
        return None
    return "online" if wandb_key() else "offline"


def wandb_host() -> str:
    return urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""


def wandb_key() -> bool:
    """An API key in the environment or where `wandb login` stores it (netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(wandb_host()) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class MLflowTracker(AccelerateMLflowTracker):
    """accelerate's MLflow tracker with a local store in the run dir by default
    (``sqlite:///<run dir>/mlflow.db``, artifacts in ``<run dir>/mlflow-artifacts``),
    telemetry off, params that MLflow accepts, and resumable by run id."""

    main_process_only = True

    def __init__(
        self,
        project: str,
        run_dir: Path,
        experiment: str | None = None,
        tracking_uri: str | None = None,
        artifact_location: str | None = None,
        log_model: bool = True,
    ) -> None:
        self.tracking_uri = tracking_uri or f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"
        db = _sqlite_file(self.tracking_uri)
        if artifact_location is None and db is not None:  # else the store's default
            artifact_location = str(db.parent.resolve() / "mlflow-artifacts")
        # artifact_location applies when this run creates the experiment. run_id
        # (accelerate's; MLFLOW_RUN_ID by default): after start, this run's id (saved).
        super().__init__(experiment or project, logging_dir=artifact_location)
        self.log_model = log_model

    def continue_from(self, step: int, run_id: str | None) -> None:
        if not os.environ.get("MLFLOW_RUN_ID"):  # an explicit run id wins, as in accelerate
            self.run_id = run_id

    @on_main_process
    def start(self) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # read when mlflow is imported
        import mlflow

        # Per job, not via MLFLOW_TRACKING_URI: jobs of a multirun share the process.
        mlflow.set_tracking_uri(self.tracking_uri)
        with _store_lock(self.tracking_uri):
            if self.run_id and not _mlflow_run_exists(self.run_id):
                log.warning(f"MLflow run {self.run_id} is not in {self.tracking_uri}: a new run")
                self.run_id = None
            super().start()
        self.run_id = self.active_run.info.run_id

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Keys with characters MLflow refuses get ``_``; keys and values are cut
        to MLflow's limits. A resumed run keeps its first values: MLflow cannot
        change a param (config.yaml has the values of this start)."""
        import mlflow
        from mlflow.utils.validation import (
            MAX_ENTITY_KEY_LENGTH,
            MAX_PARAM_VAL_LENGTH,
            MAX_PARAMS_TAGS_PER_BATCH,
        )

        params = {
            _mlflow_key(key)[:MAX_ENTITY_KEY_LENGTH]: str(value)[:MAX_PARAM_VAL_LENGTH]
            for key, value in values.items()
        }
        logged = mlflow.get_run(self.run_id).data.params
        changed = sorted(k for k in params if k in logged and logged[k] != params[k])
        if changed:
            log.info(f"MLflow keeps the first value of params changed on resume: {changed}")
        new = [(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(new[i : i + MAX_PARAMS_TAGS_PER_BATCH]))


def _mlflow_key(key: str) -> str:
    """MLflow accepts alphanumerics, ``_ - . / :`` and spaces, and no empty
    path segments (``a//b``, a leading or trailing ``/``)."""
    key = re.sub(r"[^\w.\- :/]", "_", key)
    return "/".join(part for part in key.split("/") if part not in ("", ".", "..")) or "_"


def _mlflow_run_exists(run_id: str) -> bool:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        MlflowClient().get_run(run_id)
    except MlflowException:
        return False
    return True


def _sqlite_file(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """One process at a time creates a local store and its experiment: jobs of a
    sweep sharing one sqlite store otherwise race on its migrations (seen: 3 of
    4 parallel jobs failing). A server needs no lock."""
    db = _sqlite_file(uri)
    if urlparse(uri).scheme in ("", "file"):  # a file store: a folder
        lock_file = Path(urlparse(uri).path) / ".lock"
    elif db is not None:
        lock_file = db.with_name(db.name + ".lock")
    else:
        yield
        return
    with locked(lock_file):
        yield


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    os.environ.update(values)
    try:
        yield
    finally:
        for key in values:
            os.environ.pop(key, None)


# --- readiness (preflight asks) ------------------------------------------------------
