"""Reject bad configuration values before any work starts.

Hydra already rejects unknown group options (listing the available ones) and
unknown keys (the config is in struct mode). This module checks the values,
and names the key, the value and what is allowed. Keys absent from a config
(e.g. ``weight_decay`` for an optimizer without it) are skipped.
"""

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

MIXED_PRECISION = ("no", "bf16", "fp16")
PARALLEL_MODES = ("none", "ddp", "fsdp", "deepspeed")
# Data keys named like paths (``path``, ``train_file``, ``data_dir``, ``root`` ...)
# must exist: a missing file is reported with its path before any work.
PATH_KEY = re.compile(r"(^|_)(path|file|dir|root)s?$")


class ConfigError(ValueError):
    """A configuration value is not allowed."""

    exit_code = 2


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


def _mixed_precision(v: Any) -> bool:
    # YAML reads an unquoted `no` as false; accept it as "no".
    return v is False or v in MIXED_PRECISION


RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("seed", _seed, "an integer in [0, 2**32)"),
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
    ("data.batch_size", _positive_int, "an integer >= 1"),
    ("data.val_batch_size", _positive_int, "an integer >= 1"),
    ("data.num_workers", _non_negative_int, "an integer >= 0"),
    ("data.val_fraction", _fraction, "a number between 0 and 1 (exclusive)"),
    ("data.seq_len", _positive_int, "an integer >= 1"),
    ("data.vocab_size", lambda v: _is_int(v) and v >= 2, "an integer >= 2"),
    ("data.branching", _positive_int, "an integer >= 1 (and <= data.vocab_size)"),
    ("data.num_train", _positive_int, "an integer >= 1"),
    ("data.num_val", _positive_int, "an integer >= 1"),
    ("model.dropout", lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    ("model.n_layer", _positive_int, "an integer >= 1"),
    ("model.n_head", _positive_int, "an integer >= 1"),
    ("model.d_model", _positive_int, "an integer >= 1"),
    ("scheduler.warmup_steps", _non_negative_int, "an integer >= 0"),
    ("scheduler.min_lr_ratio", lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    ("trainer.max_epochs", _optional_positive_int, "an integer >= 1 or null"),
    ("trainer.max_steps", _optional_positive_int, "an integer >= 1 or null"),
    ("trainer.grad_accum_steps", _positive_int, "an integer >= 1"),
    ("trainer.grad_clip_norm", _optional_positive_number, "a number > 0 or null (no clipping)"),
    ("trainer.mixed_precision", _mixed_precision, "one of " + ", ".join(MIXED_PRECISION)),
    ("trainer.compile", _bool, "true or false"),
    ("trainer.peak_tflops", _optional_positive_number, "a number > 0 or null"),
    ("trainer.log_every_n_steps", _positive_int, "an integer >= 1"),
    ("trainer.eval_every_n_steps", _optional_positive_int, "an integer >= 1 or null (each epoch)"),
    ("trainer.monitor_mode", lambda v: v in ("min", "max"), "min or max"),
    ("trainer.on_nan", lambda v: v in ("stop", "skip"), "stop or skip"),
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
    ("checkpoint.save_on_signal", _bool, "true or false"),
    ("checkpoint.async", _bool, "true or false"),
    (
        "checkpoint.resume",
        _resume,
        "auto, never, or an existing directory (a run dir, its checkpoints/, or one checkpoint)",
    ),
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
        elif isinstance(value, str) and PATH_KEY.search(str(key)) and not Path(value).exists():
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
    model, data = cfg.get("model", {}), cfg.get("data", {})
    d_model, n_head = model.get("d_model"), model.get("n_head")
    if _positive_int(d_model) and _positive_int(n_head) and d_model % n_head:
        problems.append(
            f"model.d_model={d_model} is not allowed: expected a multiple of model.n_head={n_head}"
        )
    branching, vocab = data.get("branching"), data.get("vocab_size")
    if _positive_int(branching) and _is_int(vocab) and branching > vocab:
        problems.append(
            f"data.branching={branching} is not allowed: expected at most data.vocab_size={vocab}"
        )
    if cfg.parallel.mode == "deepspeed" and cfg.checkpoint.get("enabled", False):
        # DeepSpeed's optimizer state holds Python objects (enums, loss-scaler
        # state) that torch.load(weights_only=True) refuses: no safe resume.
        problems.append(
            "parallel=deepspeed with checkpoint.enabled=true is not supported: DeepSpeed's "
            "optimizer state cannot be loaded safely (weights_only). Use checkpoint=none "
            "with deepspeed, or parallel=fsdp for sharded training with checkpoints"
        )
    if problems:
        raise ConfigError("Invalid configuration:\n  " + "\n  ".join(problems))


# --- config compatibility: which keys may differ when a run continues ------------------

# Config keys that may differ between a checkpoint and the run resuming it: run
# length, cadence of logs/evals/checkpoints, trackers, loader workers (the data
# order does not depend on them), and what legitimately differs per node or per
# launch (node_rank, the rendezvous address and port, the collective timeout,
# where the runs directory is). Any other difference (model, data, optimizer,
# schedule, seed, precision, ...) is refused. Edit this tuple to allow more.
ALLOWED_CONFIG_CHANGES = (
    "parallel.node_rank",
    "parallel.master_addr",
    "parallel.master_port",
    "parallel.timeout_s",
    "runs_root",
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.log_every_n_steps",
    "trainer.eval_every_n_steps",
    "trainer.on_nan",
    "trainer.compile",
    "trainer.peak_tflops",
    "tracker",
    "checkpoint",
    "run_name",
    "project",
    "preflight",
    "data.num_workers",
    "data.pin_memory",
    "data.val_batch_size",
)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): tree}


def config_differences(saved: dict, current: dict) -> list[str]:
    """``key: old -> new`` for every difference outside ALLOWED_CONFIG_CHANGES."""
    old, new = _flatten(saved), _flatten(current)
    diffs = []
    for key in sorted(set(old) | set(new)):
        if old.get(key, "<absent>") == new.get(key, "<absent>"):
            continue
        if any(key == a or key.startswith(a + ".") for a in ALLOWED_CONFIG_CHANGES):
            continue
        diffs.append(f"{key}: {old.get(key, '<absent>')!r} -> {new.get(key, '<absent>')!r}")
    return diffs
