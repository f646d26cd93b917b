"""The config: resolvers, resolution, the checks of a resolved config, and which keys
may change when a run resumes (docs/configuration.md).

The engine's keys are declared in schema/ (type, default, doc, allowed values): Hydra
composes each of its groups on its schema, so an unknown key or a value of the wrong
type stops there (entry.py says which), and ``check_config`` checks the values, naming
key, value and what is allowed, plus what spans several groups. Everything else checks
its own arguments when it is built (``require``): the project's models and data, the
schedules; torch's optimizers check theirs (``instantiate_partial`` names the group).
"""

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf

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
    struct mode so a typo in a key still fails loudly, every engine group complete
    (schema.complete: a group composed without its schema gets its defaults). An
    interpolation that cannot be resolved is a ConfigError naming the key, what it
    reads and what is there."""
    from omegaconf.errors import InterpolationResolutionError

    from .schema import complete

    cfg = complete(cfg)
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
        raise ConfigError(f"{what}: cannot build {target}{_arguments(node)}: {detail}") from err


def instantiate_partial(node: Any, what: str, *args: Any, **kwargs: Any) -> Any:
    """``instantiate(node, what)(*args, **kwargs)`` for a ``_partial_: true`` target (an
    optimizer over the task's parameter groups, a schedule over the optimizer): the
    arguments are judged by the call (torch's optimizers check theirs), so its
    ValueError or TypeError is a ConfigError too, naming the group and its arguments."""
    built = instantiate(node, what)
    try:
        return built(*args, **kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        target = node.get("_target_") if hasattr(node, "get") else node
        raise ConfigError(f"{what}: cannot build {target}{_arguments(node)}: {err}") from err


def _arguments(node: Any) -> str:
    """``(lr=-0.1, weight_decay=0.01)``: a node's own scalar arguments, for the message
    of a target that refused them (torch's optimizers say the value, not the key)."""
    if not isinstance(node, DictConfig | dict):
        return ""
    shown = [
        f"{key}={value!r}"
        for key, value in node.items()
        if not str(key).startswith("_") and isinstance(value, bool | int | float | str)
    ]
    return f"({', '.join(shown[:8])}{', ...' if len(shown) > 8 else ''})" if shown else ""


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


# --- checks of a resolved config ----------------------------------------------------------


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
    """Raise ConfigError naming every bad value at once: the engine's keys against
    their schema (each group's own checks, schema/), then what spans several groups."""
    from .schema import config_problems

    problems = config_problems(cfg)
    problems += _missing_paths(cfg.get("data") or {}, "data")
    from .adapters import problems as adapter_problems  # model.peft (it imports config)

    problems += adapter_problems(cfg)
    sharded = cfg.parallel.mode in ("fsdp", "deepspeed")
    if cfg.trainer.ema.enabled is True and sharded:
        # Their parameters are sharded: an average per rank would be of one shard.
        problems.append(
            f"trainer.ema.enabled=true is not supported with parallel={cfg.parallel.mode} "
            "(sharded parameters): use parallel=ddp or none with EMA, or trainer.ema.enabled=false"
        )
    optimizers = cfg.get("optimizers")  # absent: config_problems said so
    if optimizers and cfg.parallel.mode == "deepspeed":
        # One optimizer per DeepSpeed engine (accelerate builds one engine per model).
        problems.append(
            f"optimizers={sorted(optimizers)} is not supported with parallel=deepspeed "
            "(one optimizer per engine): use parallel=ddp or fsdp, or one optimizer"
        )
    if optimizers and cfg.trainer.mixed_precision == "fp16":
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
    """``key: old -> new`` for every difference outside ``allowed``. A key of the
    engine's schema that one config lacks (written before the key existed) counts as
    its default there: it ran as the default then. Any other key null on one side and
    absent on the other is no difference either: every reader takes both as unset (a
    project's update that declares ``model.peft: null`` resumes its older runs)."""
    from .schema import defaults

    allowed, known = tuple(allowed), defaults()
    old, new = _flatten(saved), _flatten(current)

    def value(flat: dict[str, Any], key: str) -> Any:
        if key in flat:
            return flat[key]
        default = known.get(key, "<absent>")
        linked = re.fullmatch(r"\$\{([\w.]+)\}", default) if isinstance(default, str) else None
        return flat.get(linked.group(1), "<absent>") if linked else default  # ${trainer.monitor}

    diffs = []
    for key in sorted(set(old) | set(new)):
        before, after = value(old, key), value(new, key)
        if before == after or (before in (None, "<absent>") and after in (None, "<absent>")):
            continue
        if any(key == a or key.startswith(a + ".") for a in allowed):
            continue
        diffs.append(f"{key}: {before!r} -> {after!r}")
    return diffs
