"""Experiment trackers from ``cfg.tracker`` for accelerate's tracker API (csv,
TensorBoard, W&B, MLflow); ``readiness`` for preflight. They start on the main
process only; optional packages are imported when a tracker starts (a missing
one stops the run first, naming the install). W&B/MLflow run ids are saved in
checkpoints, so a resumed run continues them. README: "Experiment trackers".
"""

import contextlib
import csv
import fcntl
import json
import logging
import netrc
import os
import re
import time
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from accelerate.tracking import GeneralTracker, on_main_process
from accelerate.tracking import MLflowTracker as AccelerateMLflowTracker
from accelerate.tracking import TensorBoardTracker as AccelerateTensorBoardTracker
from accelerate.tracking import WandBTracker as AccelerateWandBTracker
from accelerate.utils import DistributedType
from omegaconf import DictConfig, OmegaConf

from . import task
from .checkpoint import committed_checkpoints
from .config import ConfigError

log = logging.getLogger(__name__)

AVAILABLE = ("csv", "tensorboard", "wandb", "mlflow")
# Modules each tracker needs, and the extra of pyproject.toml that installs them.
REQUIRES = {
    "tensorboard": ("tensorboard",),
    "wandb": ("wandb",),
    "mlflow": ("mlflow", "sqlalchemy", "alembic", "pandas"),  # sqlite store, log_model
}


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


class TensorBoardTracker(AccelerateTensorBoardTracker):
    """accelerate's TensorBoard tracker, writing to ``<run dir>/tensorboard``.

    The config goes into the run's own event file as hparams, with
    ``hparam_metrics`` as the metric columns, so TensorBoard's HParams tab lines
    up the runs of a sweep (accelerate writes hparams as a separate,
    timestamped run). ``purge_step``: a resumed run hides what the interrupted
    run logged after the checkpoint it resumes from."""

    main_process_only = True

    def __init__(
        self, run_dir: Path, hparam_metrics: list[str] | None = None, purge_step: int | None = None
    ) -> None:
        super().__init__("tensorboard", str(run_dir), purge_step=purge_step)
        self.hparam_metrics = list(hparam_metrics or [])

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
        run_id: str | None = None,
        mode: str | None = None,
        watch: dict | None = None,
        **init_kwargs: Any,  # entity, group, tags, ...: passed to wandb.init
    ) -> None:
        super().__init__(project, **init_kwargs)
        self.run_dir = Path(run_dir)
        self.run_id = run_id  # to resume; after start, this run's id (checkpoints save it)
        self.mode = mode
        self.watch_settings = watch or {}

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
    return "online" if _wandb_key() else "offline"


def _wandb_host() -> str:
    return urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""


def _wandb_key() -> bool:
    """An API key in the environment or where `wandb login` stores it (netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(_wandb_host()) is not None
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
        run_id: str | None = None,
        experiment: str | None = None,
        tracking_uri: str | None = None,
        artifact_location: str | None = None,
        log_model: bool = True,
    ) -> None:
        self.tracking_uri = tracking_uri or f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"
        db = _sqlite_file(self.tracking_uri)
        if artifact_location is None and db is not None:  # else the store's default
            artifact_location = str(db.parent.resolve() / "mlflow-artifacts")
        # artifact_location applies when this run creates the experiment. run_id:
        # to resume; after start, this run's id (checkpoints save it).
        super().__init__(experiment or project, logging_dir=artifact_location, run_id=run_id)
        self.log_model = log_model

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
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
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


def _missing(name: str) -> list[str]:
    return [m for m in REQUIRES.get(name, ()) if find_spec(m) is None]


def readiness(cfg: DictConfig) -> tuple[str, str, str]:
    """(status pass|warn|fail, detail, fix) of the configured trackers: packages
    importable (REQUIRES), offline or online, credentials where needed."""
    parts, problems, fixes, warnings = [], [], [], []
    for name, settings in (cfg.tracker or {}).items():
        settings = settings or {}
        missing = _missing(name)
        if missing:
            problems.append(f"{name}: {', '.join(missing)} not installed")
            fixes.append(f"pip install -e '.[{name}]'")
            continue
        if name == "csv":
            parts.append("csv: metrics.csv in the run dir")
        elif name == "wandb":
            key = _wandb_key()
            mode = settings.get("mode") or os.environ.get("WANDB_MODE")
            mode = mode or ("online" if key else "offline")
            if mode == "online" and not key:
                problems.append("wandb: online, but no API key (WANDB_API_KEY or wandb login)")
                fixes.append("wandb login, or run offline (WANDB_MODE=offline)")
            else:
                parts.append(f"wandb: {mode}" + (f", key found for {_wandb_host()}" if key else ""))
        elif name == "mlflow":
            uri = (
                settings.get("tracking_uri")
                or os.environ.get("MLFLOW_TRACKING_URI")
                or "local store in the run dir"
            )
            remote = str(uri).startswith(("http://", "https://", "databricks"))
            secrets = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "DATABRICKS_TOKEN")
            if remote and not any(os.environ.get(v) for v in secrets):
                warnings.append(f"mlflow: {uri} without credentials in the environment")
            else:
                parts.append(f"mlflow: {uri}")
        else:
            parts.append(f"{name}: ready")
    if not cfg.tracker:
        parts.append("none configured")
    detail = "; ".join(parts + problems + warnings)
    if problems:
        return "fail", detail, "; ".join(fixes)
    if warnings:
        return "warn", detail, "set MLFLOW_TRACKING_TOKEN (or user/password)"
    return "pass", detail, ""


# --- building, resuming -------------------------------------------------------------


def build_trackers(cfg: DictConfig, run_dir: Path) -> list[GeneralTracker]:
    """Tracker objects for ``Accelerator(log_with=...)``; an empty list for none.
    Nothing is imported or started here (accelerate starts them on the main
    process). W&B and MLflow get the run ids of this run dir's checkpoints."""
    run_ids, resumed_step = _resume_point(cfg, Path(run_dir))
    trackers: list[GeneralTracker] = []
    for name, node in cfg.tracker.items():
        if name not in AVAILABLE:
            raise ConfigError(
                f"tracker={name!r} is not available; choose from: none, {', '.join(AVAILABLE)}"
            )
        missing = _missing(name)
        if missing:
            raise ConfigError(
                f"tracker={name} needs {', '.join(missing)}, not installed here: "
                f"pip install -e '.[{name}]'"
            )
        settings = OmegaConf.to_container(node) if node is not None else {}
        if name == "csv":
            trackers.append(CSVTracker(run_dir, **settings))
        elif name == "tensorboard":
            purge = resumed_step + 1 if resumed_step else None
            trackers.append(TensorBoardTracker(run_dir, purge_step=purge, **settings))
        elif name == "wandb":
            trackers.append(WandBTracker(cfg.project, run_dir, run_ids.get("wandb"), **settings))
        else:
            trackers.append(MLflowTracker(cfg.project, run_dir, run_ids.get("mlflow"), **settings))
    return trackers


def _resume_point(cfg: DictConfig, run_dir: Path) -> tuple[dict[str, str], int]:
    """Tracker run ids and step of this run dir's newest checkpoint, which
    ``CheckpointManager.resume`` continues from ({} and 0 for a fresh start).
    Every checkpoint of a run dir holds the same run ids, so when the newest
    is damaged and resume falls back to an older one, the ids still match."""
    ck = cfg.get("checkpoint") or {}
    if not ck.get("enabled", False) or ck.get("resume", "auto") == "never":
        return {}, 0
    for ckpt in reversed(committed_checkpoints(run_dir / "checkpoints")):
        try:
            state = json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8"))
            return dict(state.get("tracker_run_ids") or {}), int(state["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return {}, 0


# --- what only some trackers do ---------------------------------------------------


def _started(accelerator: Any, name: str) -> GeneralTracker | None:
    """The started tracker ``name``; None on other ranks (they have none)."""
    return next((t for t in accelerator.trackers if t.name == name), None)


def watch_model(accelerator: Any, model: torch.nn.Module) -> None:
    """W&B: histograms of gradients and/or parameters (``tracker.wandb.watch``)."""
    tracker = _started(accelerator, "wandb")
    if tracker is None or not tracker.watch_settings.get("log"):
        return
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        # Parameters are sharded: rank-0-only hooks would see one shard.
        log.warning("tracker.wandb.watch is skipped under FSDP/DeepSpeed (sharded parameters)")
        return
    tracker.run.watch(accelerator.unwrap_model(model), **tracker.watch_settings)


def log_final_model(accelerator: Any, cfg: DictConfig, run_dir: Path, loader: Any) -> None:
    """MLflow: ``model.safetensors`` as an artifact and, with
    ``tracker.mlflow.log_model``, the model exported with torch.export on the
    inputs (``task.inputs``) of a batch of ``loader``, read only then (no pickle:
    ``mlflow.pytorch.load_model`` loads it without this package). The model is
    rebuilt from the saved weights, so it is whole under every parallel mode."""
    tracker = _started(accelerator, "mlflow")
    if tracker is None:
        return
    import mlflow

    weights = Path(run_dir) / "model.safetensors"
    mlflow.log_artifact(str(weights))
    if not tracker.log_model:
        return
    import mlflow.pytorch
    from hydra.utils import instantiate
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec
    from safetensors.torch import load_file

    model = instantiate(cfg.model)
    model.load_state_dict(load_file(weights))
    model.eval()
    x = task.inputs(batch=next(iter(loader)))[:2].cpu()  # 2 rows: the batch dim stays dynamic
    with torch.no_grad():
        y = model(x)

    def spec(t: torch.Tensor) -> TensorSpec:
        return TensorSpec(t.numpy().dtype, (-1, *t.shape[1:]))

    try:
        mlflow.pytorch.log_model(
            model,
            name="model",
            input_example=x.numpy(),
            signature=ModelSignature(inputs=Schema([spec(x)]), outputs=Schema([spec(y)])),
            # Given, not inferred: inference loads the model in a subprocess (slow).
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
        )
    except Exception as err:  # e.g. a model torch.export cannot trace
        log.warning(f"MLflow: the model was not logged ({err}); model.safetensors was")
