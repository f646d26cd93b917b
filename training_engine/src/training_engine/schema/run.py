"""The engine's other groups and top-level keys: ``watchdog`` (hang detection),
``preflight``, ``debug``, each tracker's settings under ``tracker``, and the keys at
the top of a project's configs/train.yaml that the engine reads (``Run``)."""

# setting() and section() return dataclasses.field()s: no call shares a default.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig

from .fields import (
    BOOL,
    FRACTION,
    SECONDS,
    Check,
    Section,
    ints,
    is_int,
    numbers,
    section,
    setting,
)

REQUIRED = "???"  # no default here: the project's configs/train.yaml gives the value


@dataclass(repr=False, eq=False)
class Watchdog(Section):
    """Hang detection on every rank of a run of 2+ processes (docs/recovery.md): each
    phase of the loop has a budget; a rank past it writes every thread's stack to
    hangs/<attempt>/rank<r>.txt, names the ranks that made no progress and exits 5."""

    KEY = "watchdog"
    enabled: str | bool = setting(
        "auto",
        "auto: runs of 2+ processes | true | false",
        Check(lambda v: v in ("auto", True, False), "auto, true or false"),
    )
    first_step_s: float = setting(
        1200, "the first step of each attempt (compile, autotuning, warm-up)", SECONDS
    )
    step_floor_s: float = setting(
        120, "a step: max(step_floor_s, step_factor x p95 of the measured steps)", SECONDS
    )
    step_factor: float = setting(10, "see step_floor_s", numbers(above=0))
    eval_s: float = setting(
        1800, "an evaluation: max(eval_s, 3 x the longest one measured)", SECONDS
    )
    save_s: float = setting(
        900, "a checkpoint save: max(save_s, 3 x the longest one measured)", SECONDS
    )
    poll_s: float = setting(1, "how often each rank checks, and writes its heartbeat", SECONDS)
    collective_timeout_s: float | None = setting(
        300,
        "after the first step a collective waits this long at most (null: parallel.timeout_s)",
        numbers(above=0, null="keep parallel.timeout_s", unit="a number of seconds"),
    )


@dataclass(repr=False, eq=False)
class Preflight(Section):
    """Checks of the machine and the run before training (docs/preflight.md)."""

    KEY = "preflight"
    enabled: bool = setting(
        True, "check devices, memory, disk, speed and ETA before training", BOOL
    )
    only: bool = setting(False, "true: run the checks, write preflight.json, train nothing", BOOL)
    warmup_steps: int = setting(3, "real steps before the timed ones", ints(0))
    timed_steps: int = setting(
        10, "real optimizer steps timed for steps/s and the ETA ...", ints(1)
    )
    min_timed_seconds: float = setting(
        1.0, "... and more while they take less than this (tiny models)", numbers(at_least=0)
    )
    eval_batches: int = setting(5, "validation batches timed; the ETA scales them", ints(0))
    disk_test_mib: int = setting(16, "written, fsynced, read back beside the checkpoints", ints(1))
    memory_warn_fraction: float = setting(
        0.9, "warn when the measured peak is above this share of the device", FRACTION
    )
    loader_warn_fraction: float = setting(
        0.5, "warn when the loader alone takes more than this share of a step", FRACTION
    )

    @classmethod
    def cross_problems(cls, values: Any) -> list[str]:
        if values.only is True and values.enabled is False:
            return ["preflight.only=true with preflight=off: use preflight=default"]
        return []


@dataclass(repr=False, eq=False)
class Profile(Section):
    """torch.profiler's window (debug=profile)."""

    KEY = "debug.profile"
    wait: int = setting(1, "steps skipped first", ints(0, "active: >= 1"))
    warmup: int = setting(2, "then warm-up steps", ints(0, "active: >= 1"))
    active: int = setting(5, "then steps recorded", ints(1))
    record_shapes: bool = setting(True, "record the ops' input shapes", BOOL)
    profile_memory: bool = setting(False, "record allocations", BOOL)
    row_limit: int = setting(25, "rows of the top-ops table", ints(1))


@dataclass(repr=False, eq=False)
class Debug(Section):
    """What the debug presets switch on (configs/debug/; docs/debug.md)."""

    KEY = "debug"
    train_batches: int | None = setting(
        None, "train on the first N batches only (the same ones every epoch)", ints(1, null="all")
    )
    val_batches: int | None = setting(
        None, "validate on the first N batches only", ints(1, null="all")
    )
    val_on_train: bool = setting(
        False, "validate on the training batches (can it memorise them?)", BOOL
    )
    detect_anomaly: bool = setting(
        False, "torch.autograd.set_detect_anomaly: a NaN in backward names its op", BOOL
    )
    profile: Profile | None = setting(
        None, "{wait, warmup, active, ...}: torch.profiler over those steps"
    )


# --- each tracker's settings (tracker=csv|tensorboard|wandb|mlflow; docs/trackers.md) ------


@dataclass(repr=False, eq=False)
class Csv(Section):
    """metrics.csv in the run dir: time,step,name,value per logged value."""

    KEY = "tracker.csv"
    filename: str = setting("metrics.csv", "the file's name in the run dir")


@dataclass(repr=False, eq=False)
class TensorBoard(Section):
    """Scalars and the config as hparams, in <run dir>/tensorboard."""

    KEY = "tracker.tensorboard"
    hparam_metrics: list[str] = setting(
        ["val/acc", "val/loss", "train/loss"], "the metric columns of the HParams tab"
    )


@dataclass(repr=False, eq=False)
class WandbWatch(Section):
    """wandb.watch: histograms of gradients and/or parameters."""

    KEY = "tracker.wandb.watch"
    log: str | None = setting(
        "all",
        "gradients | parameters | all | null (off)",
        Check(
            lambda v: v in (None, "gradients", "parameters", "all"),
            "gradients, parameters, all or null",
        ),
    )
    log_freq: int = setting(100, "every N training batches", ints(1))


@dataclass(repr=False, eq=False)
class Wandb(Section):
    """Weights & Biases, offline unless WANDB_MODE or an API key says otherwise."""

    KEY = "tracker.wandb"
    mode: str | None = setting(
        None,
        "null: offline without an API key | offline | online | disabled",
        Check(
            lambda v: v in (None, "offline", "online", "disabled"),
            "null, offline, online or disabled",
        ),
    )
    entity: str | None = setting(None, "team or user (online)")
    group: str | None = setting(None, "W&B's run group")
    tags: list[str] = setting([], "W&B's run tags")
    watch: WandbWatch = section(WandbWatch, "wandb.watch")


@dataclass(repr=False, eq=False)
class MLflow(Section):
    """MLflow: params, metrics, the final model and model.safetensors."""

    KEY = "tracker.mlflow"
    experiment: str = setting("${project}", "the experiment's name")
    tracking_uri: str | None = setting(
        None,
        "null: sqlite:///<run dir>/mlflow.db; or a shared store, or a server (http://host:5000)",
    )
    artifact_location: str | None = setting(
        None, "null: mlflow-artifacts/ beside a sqlite store, else the server's"
    )
    log_model: bool = setting(True, "log the model, loadable with mlflow.pytorch.load_model", BOOL)


TRACKERS = {"csv": Csv, "tensorboard": TensorBoard, "wandb": Wandb, "mlflow": MLflow}


# --- the top-level keys ---------------------------------------------------------------------


def _module_names(v: Any) -> bool:
    return isinstance(v, list | ListConfig) and all(
        isinstance(m, str) and all(part.isidentifier() for part in m.split(".")) for m in v
    )


MAPPING = Check(lambda v: isinstance(v, dict | DictConfig), "a mapping of name -> config")


@dataclass(repr=False, eq=False)
class Run(Section):
    """The keys at the top of the config that the engine reads. Not a Hydra schema: the
    project's configs/train.yaml holds them and their values (``KEY=VALUE`` on the
    command line needs them there; ``deterministic``: the seeding group); their types
    and values are checked once the config is resolved."""

    KEY = ""
    project: str = setting(
        REQUIRED,
        "names the run in trackers",
        Check(lambda v: isinstance(v, str) and v != "", "a non-empty name"),
    )
    seed: int = setting(
        REQUIRED,
        "drives python, numpy, torch, every rank and every data worker",
        Check(lambda v: is_int(v) and 0 <= v < 2**32, "an integer in [0, 2**32)"),
    )
    deterministic: bool = setting(
        REQUIRED, "seeding=deterministic: bit-reproducible on GPUs too", BOOL
    )
    run_name: str = setting(REQUIRED, "the run directory's name under runs_root")
    runs_root: str = setting(REQUIRED, "where run directories go")
    trusted_targets: list[str] = setting(
        REQUIRED,
        "modules besides the project's whose classes a run dir's config may name (docs/trust.md)",
        Check(_module_names, "a list of module names (e.g. [mylib.models])"),
    )
    optimizers: dict[str, Any] = setting(
        REQUIRED, "more optimizers by name, each over the task's param_groups of that name", MAPPING
    )
    frozen_models: dict[str, Any] = setting(
        REQUIRED,
        "models the task's step calls but never trains (e.g. a distillation teacher)",
        MAPPING,
    )
