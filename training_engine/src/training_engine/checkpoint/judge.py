"""A checkpoint judged by what it holds, in one place, for every reader (resume,
eval.py, predict.py, generate.py, load_model, export, verify). Checksums say a file is
the one written; this says what was written is what a run of this model can hold. A
check that fails is a CheckpointError naming the file and the field: corrupt, so the
reader warns and takes the previous checkpoint, and verify says INVALID.
docs/checkpoints.md, "What a checkpoint may hold".

Before anything large is read or hashed (``before_reading``): the model file's header
(names, shapes, dtypes; the model's, when the reader has one: ``ModelSpec``), every
file's size against what it can be for that model (``limits``), and every torch file
holding only stored records (a compressed one inflates past the file's size).
After parsing (``after_parsing``): the trainer state's position (step, epoch, batch)
against the manifest, its run's length and its data; the RNG state's shape
(state.rng_problem); the optimizer state's tensors against the parameters.
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import trust
from ..state import rng_problem
from . import ties
from .format import (
    CONFIG,
    MODEL,
    OPTIMIZER,
    RNG_PREFIX,
    SCALER,
    SCHEDULER,
    TRAINER_STATE,
    CheckpointError,
)

MIB = 2**20
SMALL_STATE = MIB  # an RNG, scheduler or scaler state: a few kB, whatever the model
# Per parameter element: at most this many optimizer states of at most 8 bytes (AdamW
# keeps two of the parameter's size, Adafactor less), and a MiB for the rest
OPTIMIZER_STATES = 4
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1}
DTYPE_BYTES |= {"U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class ModelSpec:
    """What a model's state is: each tensor's shape and safetensors dtype code, and
    its tied names (an alias stored once, under the name it is tied to)."""

    tensors: dict[str, tuple[tuple[int, ...], str]]
    tied: dict[str, str] = field(default_factory=dict)
    frozen: frozenset[str] = frozenset()  # parameters that do not train (model.peft's base)

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelSpec:
        from .base import frozen_names
        from .save import SAFETENSORS_DTYPES

        state = model.state_dict()
        return cls(
            {
                k: (tuple(v.shape), SAFETENSORS_DTYPES.get(v.dtype, str(v.dtype)))
                for k, v in state.items()
            },
            ties.find(model),
            frozenset(frozen_names(model) & set(state)),
        )

    def trainable(self) -> ModelSpec:
        """What a checkpoint of the trainable weights alone holds (base.py)."""
        kept = {k: v for k, v in self.tensors.items() if k not in self.frozen}
        return ModelSpec(kept, self.tied)

    @classmethod
    def of_state(cls, state: Mapping[str, torch.Tensor]) -> ModelSpec:
        from .save import SAFETENSORS_DTYPES

        code = {k: SAFETENSORS_DTYPES.get(v.dtype, str(v.dtype)) for k, v in state.items()}
        return cls({k: (tuple(v.shape), code[k]) for k, v in state.items()})

    @property
    def bytes(self) -> int:
        return sum(math.prod(s) * DTYPE_BYTES.get(d, 8) for s, d in self.tensors.values())

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [s for s, _ in self.tensors.values()]

    @property
    def elements(self) -> int:
        return sum(math.prod(s) for s, _ in self.tensors.values())


def header_spec(path: Path) -> ModelSpec:
    """The tensors a safetensors file's header declares, no tensor read (safetensors
    checks the header against the file's size). CheckpointError if it is no such file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            specs = {}
            for key in f.keys():  # noqa: SIM118 (not a dict)
                tensor = f.get_slice(key)
                specs[key] = (tuple(tensor.get_shape()), str(tensor.get_dtype()))
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: refused: not a safetensors file ({err})") from err
    return ModelSpec(specs)


def misfit(expected: ModelSpec, found: ModelSpec) -> str | None:
    """Why the tensors ``found`` (a checkpoint's, aliases of tied weights stored once)
    are not ``expected`` (the model's): names, shapes, dtypes; None when they are."""
    want, got = expected.tensors, ties.restore(found.tensors, expected.tied)
    problems = [f"lacks {k}" for k in sorted(set(want) - set(got))]
    problems += [f"has {k}, which this model does not" for k in sorted(set(got) - set(want))]
    for k in sorted(set(want) & set(got)):
        (shape, dtype), (their_shape, their_dtype) = want[k], got[k]
        if their_shape != shape:
            problems.append(f"{k} is {list(their_shape)}, this model's {list(shape)}")
        elif their_dtype != dtype:
            problems.append(f"{k} is {their_dtype}, this model's {dtype}")
    if not problems:
        return None
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


def limits(name: str, model: ModelSpec | None) -> int | None:
    """The most bytes file ``name`` can hold in a checkpoint of ``model`` (None: no
    bound here: the model file is its header's, shards are their headers')."""
    base = name.rsplit("/", 1)[-1]
    if base.endswith(".json"):
        return trust.MAX_JSON_BYTES
    if base.startswith(RNG_PREFIX) or base in (SCHEDULER, SCALER):
        return SMALL_STATE
    if model is None or "/" in name or base == MODEL:
        return None
    if base == OPTIMIZER:
        return OPTIMIZER_STATES * 8 * model.elements + MIB
    if base.endswith(".safetensors"):  # a stateful extra's tensors (an EMA of the weights)
        return 2 * model.bytes + MIB
    return None


def stored_records(source: Path | bytes, name: str) -> None:
    """A torch file (a zip) whose records are all stored as they are, each within the
    file: what torch.save writes. A compressed record would make torch.load allocate
    more than the file holds (kilobytes on disk, gigabytes in memory)."""
    size = len(source) if isinstance(source, bytes | bytearray) else Path(source).stat().st_size
    opened = io.BytesIO(source) if isinstance(source, bytes | bytearray) else source
    try:
        with zipfile.ZipFile(opened) as archive:  # the central directory only
            for info in archive.infolist():
                if info.compress_type != zipfile.ZIP_STORED or info.file_size > size:
                    raise CheckpointError(
                        f"{name}: refused: its record {info.filename} is compressed or larger "
                        f"than the file ({info.file_size} bytes in a file of {size}); torch.save "
                        "writes stored records only"
                    )
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise CheckpointError(f"{name}: refused: not a torch file ({err})") from err


def before_reading(ckpt: Path, manifest: dict[str, Any], expected: ModelSpec | None) -> None:
    """Every check that reads no more than headers: the model file's tensors (against
    ``expected``, the reader's model, if any), every file's size against its bound for
    the model, and the torch files' records. Raises CheckpointError."""
    layout = manifest.get("layout", "full")
    model = None
    if layout in ("full", "deepspeed") and MODEL in manifest["files"]:
        model = header_spec(ckpt / MODEL)
        wrong = misfit(expected, model) if expected is not None else None
        if wrong:
            raise CheckpointError(f"{ckpt / MODEL}: its weights do not fit this model: {wrong}")
    for name, entry in manifest["files"].items():
        bound = limits(name, model)
        if bound is not None and entry["size"] > bound:
            raise CheckpointError(
                f"{ckpt / name}: {entry['size']} bytes, more than a checkpoint of this model "
                f"can hold there (at most {bound})"
            )
        if name.endswith(".pt") and "/" not in name:
            stored_records(ckpt / name, str(ckpt / name))


def after_parsing(
    ckpt: Path, manifest: dict[str, Any], parsed: Mapping[str, Any], model: ModelSpec | None
) -> None:
    """The checks across parsed files: the trainer state against the manifest and its
    run (``position_problem``), RNG states, the optimizer's tensors against ``model``'s
    (the checkpoint's own header where the reader has no model). Raises CheckpointError."""
    trainer = parsed.get(TRAINER_STATE)
    if isinstance(trainer, dict):
        for key in ("step", "epoch", "batch"):
            if key in manifest and trainer.get(key) != manifest[key]:
                raise CheckpointError(
                    f"{ckpt / TRAINER_STATE}: refused: its {key} {trainer.get(key)!r} is not "
                    f"the manifest's {manifest[key]!r}"
                )
        config = parsed.get(CONFIG)
        problem = position_problem(trainer, manifest, config if isinstance(config, dict) else {})
        if problem:
            raise CheckpointError(f"{ckpt / TRAINER_STATE}: refused: {problem}")
    for name, value in parsed.items():
        if name.startswith(RNG_PREFIX) and value is not None:
            problem = rng_problem(value)
            if problem:
                raise CheckpointError(f"{ckpt / name}: refused: {problem}")
    optimizer = parsed.get(OPTIMIZER)
    if optimizer is not None:
        if model is None and (ckpt / MODEL).is_file() and MODEL in manifest["files"]:
            model = header_spec(ckpt / MODEL)
        problem = optimizer_problem(optimizer, None if model is None else model.shapes)
        if problem:
            raise CheckpointError(f"{ckpt / OPTIMIZER}: refused: {problem}")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def position_problem(trainer: dict, manifest: dict, config: dict) -> str | None:
    """Why a trainer state's position (step, epoch, batch) cannot be one of its run
    (``config``: the checkpoint's config.json; ``manifest``: its accumulation and
    world), against the run's length and its data's batches per epoch; None if it can."""
    run = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    max_steps, max_epochs = run.get("max_steps"), run.get("max_epochs")
    step, epoch, batch = trainer["step"], trainer["epoch"], trainer["batch"]
    per_epoch = trainer.get("batches_per_epoch")  # None: a stream
    if not (_count(per_epoch) and per_epoch):  # 0: not known (a state saved outside a loop)
        per_epoch = None
    accum = manifest.get("grad_accum_steps", 1)
    world = manifest.get("world_size", 1)
    if _count(per_epoch) and batch > per_epoch:
        return f"its batch {batch} is past its epoch's {per_epoch} batches"
    if _count(max_steps) and step > max_steps:
        return f"its step {step} is past its run's length (trainer.max_steps={max_steps})"
    if _count(max_steps):  # the epochs max_steps takes (a stream: no epochs to count)
        epochs = math.ceil(max_steps * accum / per_epoch) if per_epoch else None
    else:
        epochs = max_epochs if _count(max_epochs) else None
        # a step takes a micro-batch at least, of at most per_epoch x world per epoch
        if epochs is not None and _count(per_epoch) and step > epochs * per_epoch * world:
            return f"its step {step} is past its run's length (trainer.max_epochs={epochs})"
    if epochs is not None and epoch > epochs:
        return f"its epoch {epoch} is past its run's {epochs} epochs"
    return None


def optimizer_problem(state: Any, shapes: Any) -> str | None:
    """Why a saved optimizer state cannot be one of this model's: its layout, and each
    state tensor (not a scalar) floating point and of its parameter's shape (or factored
    from it: each size its or 1, as Adafactor's). ``shapes``: a callable from a state key
    to its parameter's shape (the live optimizer's: ``live_shapes``; by name for named
    optimizers), or the model's shapes (no live optimizer: each tensor must fit one)."""
    if isinstance(state, dict) and "state" not in state and state:  # named optimizers
        for name, inner in state.items():
            problem = optimizer_problem(
                inner, shapes.get(name) if isinstance(shapes, dict) else shapes
            )
            if problem:
                return f"optimizer {name!r}: {problem}"
        return None
    if not (isinstance(state, dict) and isinstance(state.get("state"), dict)):
        return "not an optimizer state (no 'state')"
    if not isinstance(state.get("param_groups"), list):
        return "not an optimizer state (no 'param_groups')"
    for key, values in state["state"].items():
        if not isinstance(values, dict):
            return f"the state of parameter {key!r} is not a dict"
        wanted = shapes(key) if callable(shapes) else None
        if callable(shapes) and wanted is None:
            return f"it holds the state of parameter {key!r}, which this optimizer does not have"
        for name, value in values.items():
            if not isinstance(value, torch.Tensor) or value.numel() <= 1:
                continue
            shape = tuple(value.shape)
            fits = (
                _factored(shape, wanted)
                if wanted is not None
                else any(_factored(shape, s) for s in shapes or [shape])
            )
            if not fits:
                return f"state.{key}.{name} is {list(shape)}, the shape of no parameter of it"
            if not value.is_floating_point():
                return f"state.{key}.{name} is {value.dtype}, not a floating point state"
    return None


def _factored(shape: tuple[int, ...], of: tuple[int, ...]) -> bool:
    return len(shape) == len(of) and all(a in (b, 1) for a, b in zip(shape, of, strict=True))


def live_shapes(optimizer: Any, plain: torch.nn.Module) -> Any:
    """For ``optimizer_problem``: a state key's parameter shape in the live ``optimizer``
    (an index into its parameters; under FSDP2, a parameter's name), by name for
    named optimizers."""
    from ..optimizers import NamedOptimizers, by_name

    names = {n: tuple(p.shape) for n, p in plain.named_parameters()}

    def shapes_of(opt: Any) -> Any:
        params = [p for group in opt.param_groups for p in group["params"]]

        def shape(key: Any) -> tuple[int, ...] | None:
            if isinstance(key, int) and 0 <= key < len(params):
                return tuple(params[key].shape)
            return names.get(key) if isinstance(key, str) else None

        return shape

    if isinstance(getattr(optimizer, "optimizer", optimizer), NamedOptimizers):
        return {name: shapes_of(opt) for name, opt in by_name(optimizer).items()}
    return shapes_of(optimizer)
