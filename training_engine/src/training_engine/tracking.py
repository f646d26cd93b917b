"""Which experiment trackers a run gets (``cfg.tracker``: csv, TensorBoard, W&B,
MLflow; the classes are trackers.py's), starting them where a resumed run continues,
``readiness`` for preflight, and what only some trackers do (W&B's watch,
MLflow's model). A missing optional package stops the run first, naming the
install. docs/trackers.md.
"""

import logging
import os
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch
from accelerate.tracking import GeneralTracker
from accelerate.utils import DistributedType
from omegaconf import DictConfig, OmegaConf

from . import adapters, upstream
from .checkpoint import ResumePlan
from .checkpoint import format as fmt
from .config import ConfigError, flatten_config
from .trackers import (
    CSVTracker,
    MLflowTracker,
    TensorBoardTracker,
    WandBTracker,
    wandb_host,
    wandb_key,
)

log = logging.getLogger(__name__)

AVAILABLE = ("csv", "tensorboard", "wandb", "mlflow")
# Modules each tracker needs, and the extra of pyproject.toml that installs them.
REQUIRES = {
    "tensorboard": ("tensorboard",),
    "wandb": ("wandb",),
    "mlflow": ("mlflow", "sqlalchemy", "alembic", "pandas"),  # sqlite store, log_model
}


def _missing(name: str) -> list[str]:
    return [m for m in REQUIRES.get(name, ()) if find_spec(m) is None]


def readiness(cfg: DictConfig) -> tuple[str, str, str]:
    """(status pass|warn|fail, detail, fix) of the configured trackers: packages
    importable (REQUIRES), offline or online, credentials where needed."""
    parts, problems, fixes, warnings = [], [], [], []
    for name, settings in cfg.tracker.items():
        missing = _missing(name)
        if missing:
            problems.append(f"{name}: {', '.join(missing)} not installed")
            fixes.append(f"pip install -e '.[{name}]'")
            continue
        if name == "csv":
            parts.append("csv: metrics.csv in the run dir")
        elif name == "wandb":
            key = wandb_key()
            mode = settings.mode or os.environ.get("WANDB_MODE")
            mode = mode or ("online" if key else "offline")
            if mode == "online" and not key:
                problems.append("wandb: online, but no API key (WANDB_API_KEY or wandb login)")
                fixes.append("wandb login, or run offline (WANDB_MODE=offline)")
            else:
                parts.append(f"wandb: {mode}" + (f", key found for {wandb_host()}" if key else ""))
        elif name == "mlflow":
            uri = (
                settings.tracking_uri
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


def check_reachable(cfg: DictConfig, timeout_s: float = 5.0) -> None:
    """A tracker that sends to a server (MLflow with an http(s) tracking URI, W&B
    online) must reach it: ConfigError (exit 2) in seconds, before the run dir is
    claimed, instead of the client's own minutes of retries and a raw traceback."""
    for name, settings in cfg.tracker.items():
        if name == "mlflow":
            uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
            key = "tracker.mlflow.tracking_uri"
        elif name == "wandb" and (settings.mode or os.environ.get("WANDB_MODE")) == "online":
            uri, key = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"), "WANDB_BASE_URL"
        else:
            continue
        if not str(uri).startswith(("http://", "https://")):
            continue  # a local store: nothing to reach
        problem = _unreachable(str(uri), timeout_s)
        if problem:
            raise ConfigError(
                f"{key}={uri!r} is not reachable ({problem}): start the server or fix the "
                "address"
                + (
                    ", or use a local store (tracker.mlflow.tracking_uri=null)"
                    if name == "mlflow"
                    else ", or run offline (WANDB_MODE=offline)"
                )
            )


def _unreachable(uri: str, timeout_s: float) -> str | None:
    """None when a TCP connection to the URI's host and port opens within the
    timeout, else why not (any HTTP answer, even an error status, means reachable)."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(uri)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout_s):
            return None
    except OSError as err:
        return err.strerror or type(err).__name__


# --- building, resuming -------------------------------------------------------------


def build_trackers(cfg: DictConfig, run_dir: Path) -> list[GeneralTracker]:
    """Tracker objects for ``Accelerator(log_with=...)``; an empty list for none.
    Nothing is imported or started here (``start_trackers`` does, on the main process)."""
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
            trackers.append(TensorBoardTracker(run_dir, **settings))
        elif name == "wandb":
            trackers.append(WandBTracker(cfg.project, run_dir, **settings))
        else:
            trackers.append(MLflowTracker(cfg.project, run_dir, **settings))
    return trackers


def start_trackers(accelerator: Any, cfg: DictConfig, resume: ResumePlan) -> None:
    """Start the run's trackers with its config. A resumed run continues where its
    checkpoint was saved: W&B and MLflow continue the runs it logged to (their ids are
    in the checkpoint), TensorBoard and metrics.csv drop what was logged after it."""
    if resume.checkpoint is not None:
        for tracker in upstream.tracker_objects(accelerator):
            tracker.continue_from(resume.step, resume.tracker_run_ids.get(tracker.name))
    accelerator.init_trackers(cfg.project, config=flatten_config(OmegaConf.to_container(cfg)))


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


def finish_trackers(accelerator: Any) -> None:
    """Every tracker's finish (TensorBoard's flush, W&B's and MLflow's end of run),
    once, before summary.json says the run finished: a kill after the summary must
    find nothing of theirs unwritten. ``accelerator.end_training`` then finishes none."""
    trackers, accelerator.trackers = list(accelerator.trackers), []
    for tracker in trackers:
        tracker.finish()


def log_final_model(
    accelerator: Any, cfg: DictConfig, run_dir: Path, loader: Any, *, task: Any
) -> None:
    """MLflow: ``model.safetensors`` as an artifact and, with
    ``tracker.mlflow.log_model``, the model exported with torch.export on the
    inputs (``task.inputs``) of a batch of ``loader``, read only then (no pickle:
    ``mlflow.pytorch.load_model`` loads it without this package). The model is
    rebuilt from the saved weights, so it is whole under every parallel mode."""
    tracker = _started(accelerator, "mlflow")
    if tracker is None:
        return
    import mlflow

    weights = Path(run_dir) / fmt.MODEL
    mlflow.log_artifact(str(weights))
    if not tracker.log_model:
        return
    import mlflow.pytorch
    from hydra.utils import instantiate
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    from .checkpoint.ties import load_file  # tied weights: their aliases put back

    if adapters.settings(cfg.model.get(adapters.KEY)) is not None:  # its weights: the adapter
        log.info("MLflow: a model.peft run's model is not logged; export --format hf writes it")
        return
    model = instantiate(adapters.base_node(cfg.model))  # model.peft is the engine's key
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
