"""Sharded model and optimizer state (``checkpoint.format: sharded``; ``auto`` under FSDP).

Every rank writes only its own shards with torch's distributed checkpoint (DCP)
and its safetensors storage (``HuggingFaceStorageWriter(save_distributed=True)``):
``model/`` and ``optimizer/`` hold one ``shard-<rank+1>-...safetensors`` per rank;
where each shard sits in the full tensor is JSON in the safetensors headers, so
no DCP ``.metadata`` pickle is written or read. The optimizer's non-tensor values
(param-group hyperparameters) go to ``optimizer_groups.json``. Loading reads
every rank's slices from the headers, for any world size and parallel mode
(``HuggingFaceStorageReader``). No rank ever holds the full state.
docs/checkpoints.md.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from .. import moments, upstream
from ..optimizers import inner_optimizers
from . import base, full_state, ties
from . import format as fmt
from .format import SHARD_DIRS, CheckpointError

MODEL_DIR, OPTIMIZER_DIR = SHARD_DIRS
# The files DCP's safetensors writer names for rank r (its shard index is r + 1).
SHARD_NAME = "shard-{index:05d}-model-00001-of-00001.safetensors"


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def state_dicts(
    accelerator: Any, model: torch.nn.Module, optimizer: Any, trainable: bool = False
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """This rank's view of the live state, no gathering: model tensors (DTensor
    shards under FSDP; a tied parameter under its kept name only, ties.py; without
    the frozen parameters when ``trainable``, base.py), optimizer tensors (flattened,
    ``state.<param>.<key>``: kept names already) and the optimizer's plain values
    (``param_groups.<param>.<key>``, for JSON)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    plain = full_state.plain_model(accelerator, model)
    options = StateDictOptions(ignore_frozen_params=trainable)
    model_sd = ties.drop_aliases(get_model_state_dict(plain, options=options), ties.find(plain))
    optim_sd = get_optimizer_state_dict(plain, inner_optimizers(optimizer), options=_options())
    tensors = {k: v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)}
    plain_values = {k: _jsonable(v) for k, v in optim_sd.items() if k not in tensors}
    return model_sd, tensors, plain_values


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if value is None or isinstance(value, bool | int | float | str | list):
        return value
    raise CheckpointError(
        f"optimizer value {value!r} ({type(value).__name__}) is neither a tensor nor plain "
        "data: it cannot be saved without a pickle"
    )


def optimizer_groups_bytes(plain_values: dict[str, Any]) -> bytes:
    return (json.dumps(plain_values, indent=1, sort_keys=True) + "\n").encode()


def write(tmp: Path, model_sd: dict[str, Any], optim_tensors: dict[str, Any], step: int) -> None:
    """Every rank writes its shards into ``tmp/model`` and ``tmp/optimizer``
    (collectives: DCP plans the save across ranks; replicated tensors are
    written once). When a rank's write failed, raises on every rank: OSError
    for the file system's errors, CheckpointError for the rest (e.g. tensors
    that share memory or a layout safetensors cannot store)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.api import CheckpointException

    for directory, state in ((MODEL_DIR, model_sd), (OPTIMIZER_DIR, optim_tensors)):
        writer = HuggingFaceStorageWriter(str(tmp / directory), save_distributed=True)
        try:
            dcp.save(state, storage_writer=writer)
        except CheckpointException as err:
            raise write_failure(directory, err) from err
        if directory == MODEL_DIR:
            moments.reached("between_files", step)


def write_failure(directory: str, err: Any) -> OSError | CheckpointError:
    """What a failed DCP save says: the first rank's own error, as an OSError only
    when every rank's is one (a full disk, a permission), so that the message
    gives the disk advice only for those."""
    failures = sorted(getattr(err, "failures", {}).items())
    errors = [exc for _, (exc, _trace) in failures]
    first = f"rank {failures[0][0]}: {type(errors[0]).__name__}: {errors[0]}" if errors else err
    if errors and all(isinstance(e, OSError) for e in errors):
        return OSError(errors[0].errno, f"a rank could not write its {directory} shards: {first}")
    return CheckpointError(f"the {directory} shards could not be written: {first}")


def write_job(
    job: Any, failed: OSError | CheckpointError | None, rank: int
) -> OSError | CheckpointError | None:
    """Every rank writes a save job's shards (``job.shards``) into ``job.tmp``,
    then notes the files it wrote (``job.own_files``, hashed by save.py).
    Returns the first error instead of raising, as ``save.make_tmp`` does."""
    if job.shards is None or failed is not None:
        return failed
    if not job.tmp.is_dir():  # the main process failed to make it: every rank skips
        return FileNotFoundError(2, "not created", str(job.tmp))
    model_sd, optim_tensors = job.shards
    job.shards = None  # the live tensors are not kept past the write
    try:
        write(job.tmp, model_sd, optim_tensors, job.step)
    except (OSError, CheckpointError) as err:
        return err
    job.own_files = own_files(job.tmp, rank)
    return None


def own_files(tmp: Path, rank: int) -> list[Path]:
    """The shard files this rank wrote (a rank with nothing to write has none)."""
    name = SHARD_NAME.format(index=rank + 1)
    return [tmp / d / name for d in SHARD_DIRS if (tmp / d / name).is_file()]


def is_shard(name: str) -> bool:
    return name.split("/", 1)[0] in SHARD_DIRS and "/" in name


def parse(name: str, path: Path) -> Any:
    """``format.parse_file``, except that shards are only checked (DCP reads them):
    before any live object is touched, anything else in a shard's place (e.g. a
    pickle) is refused and never opened otherwise."""
    from . import format as fmt

    return fmt.check_safetensors_header(path) if is_shard(name) else fmt.parse_file(name, path)


def load(
    ckpt: Path,
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    plain_values: dict[str, Any],
    trainable: bool = False,
) -> None:
    """Restore model and optimizer from ``ckpt``'s shards into the live objects,
    whatever the world size and parallel mode now: each rank reads only the
    slices of its own shards (collectives under several processes). ``trainable``:
    the shards hold the trainable state only; the frozen parameters stay as built."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    plain = full_state.plain_model(accelerator, model)
    inner = inner_optimizers(optimizer)  # one, or the list of several (optimizers.py)
    model_sd, optim_tensors, _ = state_dicts(accelerator, model, optimizer, trainable)
    try:
        dcp.load(model_sd, storage_reader=HuggingFaceStorageReader(str(ckpt / MODEL_DIR)))
        restored = ties.restore(model_sd, ties.find(plain))
        # strict, or (trainable) strict about everything but the frozen parameters
        options = StateDictOptions(strict=not trainable)
        base.check_loaded(set_model_state_dict(plain, restored, options=options), plain)
        reader = HuggingFaceStorageReader(str(ckpt / OPTIMIZER_DIR))
        dcp.load(optim_tensors, storage_reader=reader)
    except CheckpointException as err:  # a BaseException: the caller sees a RuntimeError
        raise RuntimeError(f"the shards do not fit this model: {err}") from err
    set_optimizer_state_dict(plain, inner, {**optim_tensors, **plain_values}, options=_options())


def consolidate(ckpt: Path, tmp: Path) -> None:
    """The model shards of a sharded checkpoint as one safetensors file, written
    tensor by tensor from the shards' headers (DCP's consolidation: no full
    state in memory; the shards were hashed and their headers checked first)."""
    from safetensors import safe_open

    shards = ckpt / MODEL_DIR
    names: set[str] = set()
    for shard in shards.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            names.update(f.keys())
    with tempfile.TemporaryDirectory(dir=tmp.parent) as folder:
        written = upstream.consolidate_safetensors(str(shards), folder, sorted(names))
        os.replace(Path(folder) / written, tmp)


def full_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The whole model of a (verified) sharded checkpoint, consolidated through a
    temporary file (eval.py, load_model, export --format hf: one process)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as folder:
        whole = Path(folder) / fmt.MODEL
        consolidate(ckpt, whole)
        return load_file(whole)
