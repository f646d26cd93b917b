"""The ``checkpoint`` group: when checkpoints are saved, how many are kept, resume,
and fine-tuning from another run (configs/checkpoint/: presets; docs/checkpoints.md)."""

# setting() and section() return dataclasses.field()s: no call shares a default.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fields import BOOL, Check, Section, either, existing_dir, ints, section, setting

A_CHECKPOINT = "an existing directory (a run dir, its checkpoints/, or one checkpoint)"


def _resume(v: Any) -> bool:
    return v in ("auto", "never") or existing_dir(v)


@dataclass(repr=False, eq=False)
class SaveBest(Section):
    """A checkpoint whenever a metric reaches a new best."""

    KEY = "checkpoint.save_best"
    enabled: bool = setting(True, "save when the monitored metric reaches a new best", BOOL)
    monitor: str = setting("${trainer.monitor}", "the metric")
    mode: str = setting("${trainer.monitor_mode}", "max | min", either("min", "max"))


@dataclass(repr=False, eq=False)
class Checkpoint(Section):
    """Atomic, verified checkpoints in <run dir>/checkpoints/."""

    KEY = "checkpoint"
    enabled: bool = setting(True, "false: no checkpoints, no resume; SIGTERM stops at once", BOOL)
    every_n_steps: int | None = setting(
        500, "save every N steps (null: not by steps)", ints(1, null="")
    )
    every_n_epochs: int | None = setting(
        None, "save at the end of every N-th epoch (null: not by epochs)", ints(1, null="")
    )
    keep_last: int = setting(
        3,
        "the newest N are kept, plus the best one",
        Check(
            lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 2,
            "an integer >= 2 (the newest checkpoint may be the one a crash interrupted)",
        ),
    )
    save_best: SaveBest = section(SaveBest, "a checkpoint at each new best")
    save_last: bool = setting(True, "save at the end of training", BOOL)
    resume: str = setting(
        "auto",
        "auto: the newest valid one in this run dir | never | a path (run dir, checkpoints/, "
        "step_*)",
        Check(_resume, f"auto, never, or {A_CHECKPOINT}"),
    )
    init_from: str | None = setting(
        None,
        "fine-tune: a new run (step 0, a fresh optimizer) from another run's weights (a run "
        "dir: init_from_pick; or one step_* dir)",
        Check(lambda v: v is None or existing_dir(v), f"null or {A_CHECKPOINT}"),
    )
    init_from_pick: str = setting("best", "best | latest (for a run dir)", either("best", "latest"))
    init_from_weights: str = setting("raw", "raw | ema", either("raw", "ema"))
    init_from_strict: bool = setting(
        True, "false: load the keys that match; report the others (summary.json)", BOOL
    )
    save_on_signal: bool = setting(
        True, "SIGTERM/SIGUSR1/Ctrl-C: save at the next step, then exit 143/138/130", BOOL
    )
    async_save: bool = setting(
        False,
        "true: copy the state to CPU memory, write and commit it in a background thread",
        BOOL,
    )
    format: str = setting(
        "auto",
        "auto: sharded under FSDP, else full | full: one model.safetensors | sharded: per rank",
        Check(
            lambda v: v in ("auto", "full", "sharded"),
            "auto (sharded under FSDP, else full), full or sharded",
        ),
    )
    weights: str = setting(
        "auto",
        "auto: the trainable weights alone, base.json naming the frozen rest, when frozen "
        "parameters are most of the model (model.peft) | full | trainable",
        either("auto", "full", "trainable"),
    )
