"""The ``trainer`` group: the run's length, cadence, precision, NaN policy, early
stopping and the weights' moving average (configs/trainer/: presets)."""

# setting() and section() return dataclasses.field()s: no call shares a default.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fields import BOOL, FRACTION, Check, Section, either, ints, numbers, section, setting

MIXED_PRECISION = ("auto", "no", "bf16", "fp16")


@dataclass(repr=False, eq=False)
class EarlyStopping(Section):
    """Stop when trainer.monitor stops improving (docs/lifecycle.md)."""

    KEY = "trainer.early_stopping"
    patience: int | None = setting(
        None,
        "stop after N evaluations without improvement of trainer.monitor (null: off)",
        ints(1, null="off"),
    )
    min_delta: float = setting(
        0.0, "an improvement must exceed this (in trainer.monitor's units)", numbers(at_least=0)
    )


@dataclass(repr=False, eq=False)
class Ema(Section):
    """An exponential moving average of the weights (docs/lifecycle.md)."""

    KEY = "trainer.ema"
    enabled: bool = setting(False, "true: keep an exponential moving average of the weights", BOOL)
    decay: float = setting(
        0.999, "per optimizer step; evaluated as val_ema/*, saved in checkpoints", FRACTION
    )


@dataclass(repr=False, eq=False)
class Trainer(Section):
    """How long and how a run trains."""

    KEY = "trainer"
    max_epochs: int | None = setting(
        20, "epochs (trainer.max_steps wins when set)", ints(1, null="")
    )
    max_steps: int | None = setting(
        None, "optimizer steps; when set, it wins over max_epochs", ints(1, null="")
    )
    grad_accum_steps: int = setting(1, "micro-batches per optimizer step", ints(1))
    grad_clip_norm: float | None = setting(
        1.0,
        "clip the gradients' norm to this (null: no clipping)",
        numbers(above=0, null="no clipping"),
    )
    # A str or a bool: YAML reads an unquoted `no` as false, which means "no".
    mixed_precision: str | bool = setting(
        "auto",
        "auto (bf16 on a GPU that has it, else fp32) | no | bf16 | fp16 (GPUs; grad scaler)",
        Check(lambda v: v is False or v in MIXED_PRECISION, "one of " + ", ".join(MIXED_PRECISION)),
    )
    compile: bool = setting(
        False, "true: torch.compile the model (inductor; the first steps compile)", BOOL
    )
    peak_tflops: float | None = setting(
        None,
        "per device, for perf/mfu (null: known GPUs' bf16 peak, none on CPU)",
        numbers(above=0, null=""),
    )
    log_every_n_steps: int = setting(10, "log (and agree across ranks) every N steps", ints(1))
    eval_every_n_steps: int | None = setting(
        None,
        "evaluate every N steps (null: at the end of every epoch; always at the end)",
        ints(1, null="each epoch"),
    )
    eval_at_start: bool = setting(
        False, "true: also evaluate before the first step (a fine-tune's starting point)", BOOL
    )
    monitor: str = setting("val/acc", "the metric train.py returns and the best is judged by")
    monitor_mode: str = setting(
        "max", "max | min: which way monitor improves", either("min", "max")
    )
    on_nan: str = setting(
        "stop",
        "NaN/inf loss: stop (exit 3, names the step) | skip (drop the update)",
        either("stop", "skip"),
    )
    skip_budget: int | None = setting(
        10,
        "on_nan=skip: more updates dropped in a row stop the run (exit 3); null: no limit",
        ints(1, null="no limit"),
    )
    early_stopping: EarlyStopping = section(EarlyStopping, "patience on trainer.monitor")
    ema: Ema = section(Ema, "a moving average of the weights")

    @classmethod
    def cross_problems(cls, values: Any) -> list[str]:
        if values.max_epochs is None and values.max_steps is None:
            return ["trainer.max_epochs and trainer.max_steps are both null: set at least one"]
        return []
