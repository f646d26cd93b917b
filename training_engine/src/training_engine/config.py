"""The config: resolvers, resolution, value checks of the infrastructure's own keys,
and which keys may change when a run resumes (docs/configuration.md).

Hydra rejects unknown options and keys (struct mode); ``check_config`` checks
values, naming key, value and what is allowed. The example model and data check
their own arguments (``require``) in their constructors.
"""

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, MissingMandatoryValue, OmegaConf

MIXED_PRECISION = ("auto", "no", "bf16", "fp16")
PARALLEL_MODES = ("none", "ddp", "fsdp", "deepspeed")
# Data keys named like paths (``path``, ``train_file``, ``data_dir``, ``root`` ...)
# must exist: a missing file is reported with its path before any work. Caches are
# written, not read (``cache_dir``), and a glob (``files: corpus/*.txt``) is the data
# function's to match: neither is checked here.
PATH_KEY = re.compile(r"(^|_)(path|file|dir|root)s?$")
NOT_READ = re.compile(r"^cache(_|$)")
GLOB = re.compile(r"[*?\[]")


class ConfigError(ValueError):
    """A configuration value is not allowed."""

    exit_code = 2


def require(key: str, value: Any, ok: bool, expected: str) -> None:
    """For models and data checking their own arguments: raise ConfigError
    ``key=value is not allowed: expected ...`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is not allowed: expected {expected}")


# --- resolvers and resolution -----------------------------------------------------------


def register_resolvers(project_root: Path | None = None) -> None:
    """``${default_run_name:}``, ``${launch_stamp:}`` and ``${project_root:}``
    (the directory holding train.py; default: the working directory) for
    configs/train.yaml, and ``${sidecar:FILE,KEY}`` and ``${tokenizer_vocab:PATH}`` for
    data configs. Call before composing."""
    from .run_dir import default_run_name, launch_stamp  # the run dir owns the naming rule

    root = str(Path(project_root or Path.cwd()).resolve())
    register = OmegaConf.register_new_resolver
    register("default_run_name", default_run_name, replace=True, use_cache=True)
    register("launch_stamp", launch_stamp, replace=True, use_cache=True)
    register("project_root", lambda: root, replace=True)
    register("sidecar", sidecar, replace=True)
    register("tokenizer_vocab", tokenizer_vocab, replace=True)


def sidecar(path: str, key: str) -> Any:
    """``${sidecar:FILE,KEY}``: KEY of the JSON file next to a data file (FILE with
    the suffix ``.json``, e.g. ``train.bin`` -> ``train.json``), so a value the data
    knows (its vocabulary size) is written once, by whoever wrote the data, and the
    model's config reads it as ``${data.vocab_size}``."""
    if not Path(path).is_file():
        raise ConfigError(f"the data file {path} does not exist (its {key} is read from it)")
    meta = Path(path).with_suffix(".json")
    if not meta.is_file():
        raise ConfigError(
            f"no {meta} next to the data file {path} (it should hold {key!r}); write it, "
            "or give the value in the data config instead of ${sidecar:...}"
        )
    values = json.loads(meta.read_text())
    if key not in values:
        raise ConfigError(f"{meta} has no key {key!r}; it has: {', '.join(sorted(values))}")
    return values[key]


def tokenizer_vocab(path: str | None) -> int:
    """``${tokenizer_vocab:PATH}``: the vocabulary size of a tokenizer (null: bytes, 257),
    so a text data option gives the model the value it needs."""
    from .tokenizer import vocab_size

    return vocab_size(path)


def resolve_config(cfg: DictConfig) -> DictConfig:
    """A fully resolved copy with no ``${...}`` left and no link to Hydra, in
    struct mode so a typo in a key still fails loudly. An interpolation that cannot
    be resolved is a ConfigError naming the key, what it reads and what is there."""
    from omegaconf.errors import InterpolationResolutionError

    try:
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except InterpolationResolutionError as err:
        cause = err.__cause__ or err.__context__  # OmegaConf chains the resolver's error
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:  # a resolver's own clear error (sidecar)
            raise cause from None
        raise ConfigError(_unresolvable(cfg, err)) from None
    except MissingMandatoryValue as err:
        raise ConfigError(
            f"{err.full_key} has no value (???): give it on the command line, "
            f"e.g. {err.full_key}=VALUE"
        ) from None
    from .trust import literal  # the resolved values are data: a ``${`` left in them is text

    resolved = OmegaConf.create(literal(container))
    OmegaConf.set_struct(resolved, True)
    return resolved


def _unresolvable(cfg: DictConfig, err: Exception) -> str:
    """The message for an interpolation that reads a key that is not there, e.g.
    model.vocab_size=${data.vocab_size} with a data option that has no vocab_size."""
    key = getattr(err, "full_key", "") or "?"
    try:  # the interpolation as written, e.g. '${data.vocab_size}'
        raw: Any = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            raw = raw[part]
    except (KeyError, TypeError, ValueError):
        raw = None
    message = f"{key}={raw!r} cannot be resolved: {str(err).splitlines()[0]}"
    missing = re.search(r"Interpolation key '([^']+)' not found", str(err))
    if missing:
        wanted = missing.group(1)
        group, _, leaf = wanted.rpartition(".")
        node = OmegaConf.select(cfg, group, throw_on_resolution_failure=False) if group else cfg
        there = ", ".join(sorted(str(k) for k in node)) if isinstance(node, DictConfig) else ""
        message = (
            f"{key}={raw!r} reads {wanted}, which this config does not have"
            + (f" ({group} has: {there})" if there else "")
            + f". Choose a {group or 'config'} option that provides {leaf}, or set it: "
            f"+{wanted}=VALUE"
        )
    return message


def instantiate(node: Any, what: str = "config", **kwargs: Any) -> Any:
    """``hydra.utils.instantiate``, where a target that cannot be built is a
    configuration error (exit code 2) naming ``what`` (the group): a ConfigError
    raised by the target (a model or data function checking its arguments)
    comes out as itself, a missing file with its path, anything else with the
    target and the reason, never wrapped in Hydra's InstantiationException."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        if isinstance(cause, FileNotFoundError) and cause.filename:
            raise ConfigError(f"{what}: no such file or directory: {cause.filename}") from err
        detail = str(cause) if cause is not None else str(err).splitlines()[0]
        target = node.get("_target_") if hasattr(node, "get") else node
        raise ConfigError(f"{what}: cannot build {target}: {detail}") from err


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


# --- value checks -----------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _positive_int(v: Any) -> bool:
    return _is_int(v) and v >= 1


def _optional_positive_int(v: Any) -> bool:
    return v is None or _positive_int(v)


def _non_negative_int(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _positive_number(v: Any) -> bool:
    return _is_number(v) and v > 0


def _optional_positive_number(v: Any) -> bool:
    return v is None or _positive_number(v)


def _non_negative_number(v: Any) -> bool:
    return _is_number(v) and v >= 0


def _fraction(v: Any) -> bool:
    return _is_number(v) and 0 < v < 1


def _seed(v: Any) -> bool:
    return _is_int(v) and 0 <= v < 2**32


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _resume(v: Any) -> bool:
    # auto | never | an existing run dir, checkpoints/ dir or checkpoint dir
    return v in ("auto", "never") or (isinstance(v, str) and v != "" and Path(v).is_dir())


def _num_processes(v: Any) -> bool:
    return v == "auto" or _positive_int(v)


def _port(v: Any) -> bool:
    return v is None or (_is_int(v) and 1 <= v <= 65535)


def _module_names(v: Any) -> bool:
    return isinstance(v, list | ListConfig) and all(
        isinstance(m, str) and all(part.isidentifier() for part in m.split(".")) for m in v
    )


def _class_names(v: Any) -> bool:
    names = list(v) if isinstance(v, list | tuple | ListConfig) else None
    return v is None or (
        bool(names) and all(isinstance(n, str) and n.isidentifier() for n in names)
    )


def _mixed_precision(v: Any) -> bool:
    # YAML reads an unquoted `no` as false; accept it as "no".
    return v is False or v in MIXED_PRECISION


RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("seed", _seed, "an integer in [0, 2**32)"),
    ("trusted_targets", _module_names, "a list of module names (e.g. [mylib.models])"),
    ("deterministic", lambda v: isinstance(v, bool), "true or false"),
    ("optimizer.lr", _positive_number, "a number > 0"),
    ("optimizer.weight_decay", _non_negative_number, "a number >= 0"),
    ("optimizer.momentum", _non_negative_number, "a number >= 0"),
    ("parallel.mode", lambda v: v in PARALLEL_MODES, "one of " + ", ".join(PARALLEL_MODES)),
    ("parallel.num_processes", _num_processes, "auto or an integer >= 1 (processes per node)"),
    ("parallel.cpu_processes", _positive_int, "an integer >= 1 (what auto means without GPUs)"),
    ("parallel.num_nodes", _positive_int, "an integer >= 1"),
    ("parallel.node_rank", _non_negative_int, "an integer >= 0 (below parallel.num_nodes)"),
    ("parallel.master_port", _port, "null or a port number in 1..65535"),
    ("parallel.backend", lambda v: v in ("auto", "gloo", "nccl"), "auto, gloo or nccl"),
    ("parallel.timeout_s", _positive_number, "a number of seconds > 0"),
    ("parallel.max_restarts", _non_negative_int, "an integer >= 0 (in-job restarts)"),
    ("watchdog.enabled", lambda v: v in ("auto", True, False), "auto, true or false"),
    ("watchdog.first_step_s", _positive_number, "a number of seconds > 0"),
    ("watchdog.step_floor_s", _positive_number, "a number of seconds > 0"),
    ("watchdog.step_factor", _positive_number, "a number > 0"),
    ("watchdog.eval_s", _positive_number, "a number of seconds > 0"),
    ("watchdog.save_s", _positive_number, "a number of seconds > 0"),
    ("watchdog.poll_s", _positive_number, "a number of seconds > 0"),
    (
        "watchdog.collective_timeout_s",
        _optional_positive_number,
        "a number of seconds > 0 or null (keep parallel.timeout_s)",
    ),
    ("parallel.wrap_classes", _class_names, "null or a list of class names, e.g. [Block]"),
    ("parallel.auto_wrap_min_params", _positive_int, "an integer >= 1"),
    ("parallel.reshard_after_forward", _bool, "true or false"),
    ("parallel.cpu_offload", _bool, "true or false"),
    ("parallel.activation_checkpointing", _bool, "true or false"),
    ("parallel.zero3_init", _bool, "true or false"),
    ("scheduler.warmup_steps", _non_negative_int, "an integer >= 0"),
    ("scheduler.min_lr_ratio", lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    ("trainer.max_epochs", _optional_positive_int, "an integer >= 1 or null"),
    ("trainer.max_steps", _optional_positive_int, "an integer >= 1 or null"),
    ("trainer.grad_accum_steps", _positive_int, "an integer >= 1"),
    ("trainer.grad_clip_norm", _optional_positive_number, "a number > 0 or null (no clipping)"),
    ("trainer.mixed_precision", _mixed_precision, "one of " + ", ".join(MIXED_PRECISION)),
    ("trainer.compile", _bool, "true or false"),
    ("trainer.eval_at_start", _bool, "true or false"),
    ("trainer.peak_tflops", _optional_positive_number, "a number > 0 or null"),
    ("trainer.log_every_n_steps", _positive_int, "an integer >= 1"),
    ("trainer.eval_every_n_steps", _optional_positive_int, "an integer >= 1 or null (each epoch)"),
    ("trainer.monitor_mode", lambda v: v in ("min", "max"), "min or max"),
    ("trainer.on_nan", lambda v: v in ("stop", "skip"), "stop or skip"),
    ("trainer.skip_budget", _optional_positive_int, "an integer >= 1 or null (no limit)"),
    ("checkpoint.enabled", _bool, "true or false"),
    ("checkpoint.every_n_steps", _optional_positive_int, "an integer >= 1 or null"),
    ("checkpoint.every_n_epochs", _optional_positive_int, "an integer >= 1 or null"),
    (
        "checkpoint.keep_last",
        lambda v: _is_int(v) and v >= 2,
        "an integer >= 2 (the newest checkpoint may be the one a crash interrupted)",
    ),
    ("checkpoint.save_best.enabled", _bool, "true or false"),
    ("checkpoint.save_best.mode", lambda v: v in ("min", "max"), "min or max"),
    ("checkpoint.save_last", _bool, "true or false"),
    (
        "checkpoint.format",
        lambda v: v in ("auto", "full", "sharded"),
        "auto (sharded under FSDP, else full), full or sharded",
    ),
    ("checkpoint.save_on_signal", _bool, "true or false"),
    ("checkpoint.async", _bool, "true or false"),
    (
        "checkpoint.resume",
        _resume,
        "auto, never, or an existing directory (a run dir, its checkpoints/, or one checkpoint)",
    ),
    (
        "checkpoint.init_from",
        lambda v: v is None or (_resume(v) and v not in ("auto", "never")),
        "null or an existing directory (a run dir, its checkpoints/, or one checkpoint)",
    ),
    ("checkpoint.init_from_pick", lambda v: v in ("best", "latest"), "best or latest"),
    ("checkpoint.init_from_weights", lambda v: v in ("raw", "ema"), "raw or ema"),
    ("checkpoint.init_from_strict", _bool, "true or false"),
    ("trainer.ema.enabled", _bool, "true or false"),
    ("trainer.ema.decay", _fraction, "a number between 0 and 1 (exclusive)"),
    ("trainer.early_stopping.patience", _optional_positive_int, "an integer >= 1 or null (off)"),
    ("trainer.early_stopping.min_delta", _non_negative_number, "a number >= 0"),
    ("preflight.enabled", _bool, "true or false"),
    ("preflight.only", _bool, "true or false"),
    ("preflight.warmup_steps", _non_negative_int, "an integer >= 0"),
    ("preflight.timed_steps", _positive_int, "an integer >= 1"),
    ("preflight.min_timed_seconds", _non_negative_number, "a number >= 0"),
    ("preflight.eval_batches", _non_negative_int, "an integer >= 0"),
    ("preflight.disk_test_mib", _positive_int, "an integer >= 1"),
    ("preflight.memory_warn_fraction", _fraction, "a number between 0 and 1 (exclusive)"),
    ("preflight.loader_warn_fraction", _fraction, "a number between 0 and 1 (exclusive)"),
]


def _missing_paths(node: Any, prefix: str) -> list[str]:
    """Path-named string values under ``data`` that do not exist on disk."""
    problems = []
    for key, value in node.items():
        name = f"{prefix}.{key}"
        if isinstance(value, DictConfig | dict):
            problems += _missing_paths(value, name)
        elif (
            isinstance(value, str)
            and PATH_KEY.search(str(key))
            and not NOT_READ.search(str(key))
            and not GLOB.search(value)
            and not Path(value).exists()
        ):
            problems.append(
                f"{name}={value!r} is not allowed: no such file or directory "
                f"({Path(value).resolve()})"
            )
    return problems


def check_config(cfg: DictConfig) -> None:
    """Raise ConfigError naming every bad value at once."""
    problems = []
    for key, ok, allowed in RULES:
        value = OmegaConf.select(cfg, key, default="<absent>", throw_on_missing=True)
        if value != "<absent>" and not ok(value):
            problems.append(f"{key}={value!r} is not allowed: expected {allowed}")
    trainer = cfg.trainer
    if trainer.max_epochs is None and trainer.max_steps is None:
        problems.append("trainer.max_epochs and trainer.max_steps are both null: set at least one")
    p = cfg.get("parallel") or {}
    node_rank, num_nodes = p.get("node_rank", 0), p.get("num_nodes", 1)
    if _is_int(node_rank) and _positive_int(num_nodes) and node_rank >= num_nodes:
        problems.append(
            f"parallel.node_rank={node_rank} is not allowed: expected 0..{num_nodes - 1} "
            f"(parallel.num_nodes={num_nodes})"
        )
    if _positive_int(num_nodes) and num_nodes > 1 and p.get("master_port") is None:
        problems.append(
            f"parallel.master_port=None is not allowed with parallel.num_nodes={num_nodes}: "
            "every node must name the same port (e.g. parallel.master_port=29500)"
        )
    problems += _missing_paths(cfg.get("data") or {}, "data")
    if cfg.preflight.get("only", False) and not cfg.preflight.get("enabled", False):
        problems.append("preflight.only=true with preflight=off: use preflight=default")
    ema = (cfg.trainer.get("ema") or {}).get("enabled", False)
    if ema is True and cfg.parallel.mode in ("fsdp", "deepspeed"):
        # Their parameters are sharded: an average per rank would be of one shard.
        problems.append(
            f"trainer.ema.enabled=true is not supported with parallel={cfg.parallel.mode} "
            "(sharded parameters): use parallel=ddp or none with EMA, or trainer.ema.enabled=false"
        )
    if cfg.get("optimizers") and cfg.parallel.mode == "deepspeed":
        # One optimizer per DeepSpeed engine (accelerate builds one engine per model).
        problems.append(
            f"optimizers={sorted(cfg.optimizers)} is not supported with parallel=deepspeed "
            "(one optimizer per engine): use parallel=ddp or fsdp, or one optimizer"
        )
    if cfg.get("optimizers") and cfg.trainer.mixed_precision == "fp16":
        problems.append(
            "trainer.mixed_precision=fp16 is not supported with several optimizers (one grad "
            "scaler steps one optimizer here): use bf16 or no"
        )
    if problems:
        raise ConfigError("Invalid configuration:\n  " + "\n  ".join(problems))


# --- what may change on resume ------------------------------------------------------------

# Config keys that may differ between a checkpoint and the run resuming it: run
# length, cadence of logs/evals/checkpoints, trackers, preflight, and what
# legitimately differs per node or per launch (node_rank, the rendezvous address
# and port, the collective timeout, where the runs directory is). Any other
# difference (model, data, optimizer, schedule, seed, precision, ...) is refused.
# The data and model add their own such arguments (``resume_may_change``, below).
# Elastic resume: the number of processes and the parallel mode (with the layout
# options that come with a mode) may change; the checkpoint restores onto any of
# them, and the global batch is kept where it can be (checkpoint/elastic.py).
ALLOWED_CONFIG_CHANGES = (
    "parallel.mode",
    "parallel.num_processes",
    "parallel.cpu_processes",
    "parallel.num_nodes",
    "parallel.backend",  # a transport (parallel=none has none)
    "parallel.find_unused_parameters",
    "parallel.wrap_classes",
    "parallel.auto_wrap_min_params",
    "parallel.reshard_after_forward",
    "parallel.cpu_offload",
    "parallel.activation_checkpointing",
    "parallel.zero3_init",
    "parallel.node_rank",
    "parallel.master_addr",
    "parallel.master_port",
    "parallel.timeout_s",
    "parallel.max_restarts",
    "watchdog",
    "runs_root",
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.log_every_n_steps",
    "trainer.eval_every_n_steps",
    "trainer.eval_at_start",
    "trainer.on_nan",
    "trainer.skip_budget",
    "trainer.early_stopping",
    "trainer.compile",
    "trainer.peak_tflops",
    "tracker",
    "callbacks",  # actions at events; a callback's state is restored when it is there
    "checkpoint",
    "run_name",
    "project",
    "preflight",
    "trusted_targets",
)


def allowed_config_changes(config: dict) -> tuple[str, ...]:
    """ALLOWED_CONFIG_CHANGES plus the arguments the configured data and model
    functions declare harmless to change (a ``resume_may_change`` tuple on the
    ``_target_``, e.g. loader workers: the data order does not depend on them)."""
    from hydra.utils import get_object

    allowed = list(ALLOWED_CONFIG_CHANGES)
    for group in ("data", "model"):
        target = (config.get(group) or {}).get("_target_")
        try:
            declared = getattr(get_object(target), "resume_may_change", ()) if target else ()
        except Exception:  # not importable here: nothing extra allowed
            declared = ()
        allowed += [f"{group}.{key}" for key in declared]
    return tuple(allowed)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): tree}


def config_differences(
    saved: dict, current: dict, allowed: Iterable[str] = ALLOWED_CONFIG_CHANGES
) -> list[str]:
    """``key: old -> new`` for every difference outside ``allowed``."""
    allowed = tuple(allowed)
    old, new = _flatten(saved), _flatten(current)
    diffs = []
    for key in sorted(set(old) | set(new)):
        if old.get(key, "<absent>") == new.get(key, "<absent>"):
            continue
        if any(key == a or key.startswith(a + ".") for a in allowed):
            continue
        diffs.append(f"{key}: {old.get(key, '<absent>')!r} -> {new.get(key, '<absent>')!r}")
    return diffs
