"""The model and optimizer state to save and to load, under every parallel
mode: as full tensors (``checkpoint.format: full``; gathered from and scattered
to FSDP shards: what DDP and single-process runs use), or, for ``sharded``
(``auto`` under FSDP), each rank's own shards (sharded.py). Both load into any
world size and parallel mode. Under DeepSpeed (layout ``deepspeed``) its own
files hold the optimizer and the partitions (zero.py), beside the gathered
model. Also the run's final ``model.safetensors``, and whether one on disk is the
file its ``summary.json`` records (``final_weights_problem``). Tied
parameters are stored once under both layouts and re-tied on load (ties.py).
docs/checkpoints.md.
"""

import json
import os
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType
from safetensors.torch import save as save_safetensors
from torch.nn import DataParallel
from torch.nn.parallel import DistributedDataParallel

from .. import moments, trust, upstream
from ..files import fsync_dir, temporary, write_durable
from ..optimizers import inner_optimizers
from . import base, checksums, save, sharded, ties, zero
from . import format as fmt


def take(
    layout: str, accelerator: Any, model: torch.nn.Module, optimizer: Any, trainable: bool = False
) -> tuple[dict[str, Any], tuple | None, dict[str, bytes]]:
    """What a save writes, taken now on every rank: the main process's full
    tensors by file name (``full``; collectives under FSDP), or this rank's
    shards (``sharded``, for ``sharded.write_job``), and extra small files.
    ``trainable``: the model's trainable state only (base.py)."""
    main = accelerator.is_main_process
    tied = ties.find(plain_model(accelerator, model))
    if layout == "sharded":
        model_sd, optim_tensors, plain = sharded.state_dicts(
            accelerator, model, optimizer, trainable
        )
        extra = {fmt.OPTIMIZER_GROUPS: sharded.optimizer_groups_bytes(plain)} if main else {}
        shards, tensors = (model_sd, optim_tensors), {}
    elif layout == "deepspeed":  # the optimizer: DeepSpeed's own files (zero.write_job)
        weights = model_state(accelerator, model)  # gathered on the main process (ZeRO-3)
        tied = ties.in_state(tied, weights) if main else tied
        shards, extra = None, {}
        tensors = {"model.safetensors": ties.drop_aliases(weights, tied)} if main else {}
    else:
        weights = model_state(accelerator, model, trainable)  # every name, tied ones too
        tied = ties.in_state(tied, weights)
        state = ties.drop_aliases(weights, tied), optimizer_state(accelerator, model, optimizer)
        shards, extra = None, {}
        tensors = {fmt.MODEL: state[0], fmt.OPTIMIZER: state[1]} if main else {}
    if tied and main:  # the aliases dropped (sharded.state_dicts too), recorded here
        extra[ties.TIES_FILE] = ties.to_bytes(tied)
    return tensors, shards, extra


def restore(
    layout: str,
    ckpt: Path,
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    loaded: dict[str, Any],
    trainable: bool = False,
) -> None:
    """Load a verified checkpoint's model and optimizer (``loaded``: its parsed files;
    ``trainable``: it holds the trainable state only, its base checked already)."""
    if layout == "sharded":
        groups = loaded[fmt.OPTIMIZER_GROUPS]
        sharded.load(ckpt, accelerator, model, optimizer, groups, trainable)
    elif layout == "deepspeed":
        zero.load(ckpt, model)  # the engine; the world size was checked (resume.verify)
    else:
        weights = ties.restore(loaded[fmt.MODEL], ties.of_checkpoint(loaded, ckpt))
        load_model_and_optimizer(
            accelerator, model, optimizer, weights, loaded[fmt.OPTIMIZER], trainable
        )


def plain_model(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    """The model without DDP's and torch.compile's wrappers: the parameter
    names its class defines, with or without ``trainer.compile``.

    Hand-written except under DeepSpeed: accelerate's ``unwrap_model`` imports
    deepspeed whenever it is installed, to recognise its engine (about 2 s on
    2 cores, paid in the first save of every run that does not use it)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.unwrap_model(model, keep_torch_compile=False)
    from torch.distributed.fsdp import FullyShardedDataParallel  # FSDP1; FSDP2 wraps nothing

    wrappers = (DistributedDataParallel, DataParallel, FullyShardedDataParallel)
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif upstream.compiled_original(model) is not None:  # torch.compile's wrapper
            model = upstream.compiled_original(model)
        else:
            return model


def model_state(
    accelerator: Any, model: torch.nn.Module, trainable: bool = False
) -> dict[str, torch.Tensor]:
    """The full model state; a collective under FSDP and ZeRO-3 (DeepSpeed's
    16-bit gather, asked of the engine: the main process alone holds the result,
    gathered one layer at a time; the others get an empty dict). ``trainable``: without
    the frozen parameters, which FSDP then does not gather at all."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.get_state_dict(model) or {}  # the engine, unwrapped inside
    plain = plain_model(accelerator, model)
    if trainable and accelerator.is_fsdp2:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=True
        )
        return get_model_state_dict(plain, options=options)
    state = accelerator.get_state_dict(plain, unwrap=False)
    return base.trainable_state(state, plain) if trainable else state


def optimizer_state(accelerator: Any, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer state as plain tensors; a collective under FSDP."""
    if not accelerator.is_fsdp2:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(
        plain_model(accelerator, model), inner_optimizers(optimizer), options=options
    )


def load_model_and_optimizer(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    trainable: bool = False,
) -> None:
    """Load full states; under FSDP every rank shards its copy. Tied parameters
    (stored once) get their aliases back first: a strict load sets every name
    (``trainable``: every name but the frozen parameters', which stay as built)."""
    plain = plain_model(accelerator, model)
    model_state = ties.restore(model_state, ties.find(plain))
    if not accelerator.is_fsdp2:
        base.check_loaded(plain.load_state_dict(model_state, strict=not trainable), plain)
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # a partial full state (trainable) keeps every other parameter's own local shard
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(plain, model_state, options=options)
    set_optimizer_state_dict(plain, inner_optimizers(optimizer), optimizer_state, options=options)


def save_final_weights(
    accelerator: Any, model: torch.nn.Module, run_dir: Path, frozen: Any = None
) -> dict[str, Any] | None:
    """``run_dir/model.safetensors``: the full model in one file, every name its
    class defines but the aliases of tied weights (stored once, named in the
    metadata: ``ties.load_file`` puts them back), written by the main process and
    fsynced; a collective under FSDP and ZeRO-3 (gathered, ``model_state``). Not
    accelerate's ``save_model``: it unwraps the model through ``unwrap_model`` again
    (see ``plain_model``). Returns the file's entry (size and checksum) for
    summary.json's ``final_weights`` on the main process, None on the others.
    ``frozen`` (a base.Base): the trainable state only, as the checkpoints hold it, with
    the base it stands on in the metadata (``"base"``)."""
    state = model_state(accelerator, model, trainable=frozen is not None)
    tied = ties.find(plain_model(accelerator, model))
    tied = ties.in_state(tied, state) if accelerator.is_main_process else tied
    metadata = {"format": "pt", **({ties.METADATA_KEY: json.dumps(tied)} if tied else {})}
    if frozen is not None:
        metadata[base.METADATA_KEY] = json.dumps(frozen.to_json())
    entry = None
    if accelerator.is_main_process:  # atomic: a crash leaves the old file or none
        final = Path(run_dir) / fmt.MODEL
        data = save_safetensors(save.unshared(ties.drop_aliases(state, tied)), metadata=metadata)
        try:
            write_durable(temporary(final), data)
            moments.reached("final_weights")  # written, not renamed
            os.replace(temporary(final), final)
        except OSError:
            temporary(final).unlink(missing_ok=True)  # a full disk: nothing half-written left
            raise
        fsync_dir(final.parent)
        entry = checksums.file_entry(data)
    accelerator.wait_for_everyone()
    return entry


def final_weights_problem(run_dir: Path, recorded: Any) -> str | None:
    """None when ``run_dir/model.safetensors`` is the file summary.json's
    ``final_weights`` entry (``recorded``) describes: a regular file of that size and
    checksum, whose safetensors header parses; else what is wrong. A summary written
    before the entry existed (None): a complete safetensors file. Read-only; reads the
    file once (XXH3, ~5 GB/s)."""
    path = Path(run_dir) / fmt.MODEL
    if not os.path.lexists(path):
        return f"{path} is missing"
    try:
        trust.regular_file(path)
        fmt.check_safetensors_header(path)  # also a file cut short: its header says more
    except (trust.Malformed, fmt.CheckpointError) as err:
        return str(err)
    if recorded is None:
        return None
    size = path.stat().st_size
    if not isinstance(recorded, dict) or recorded.get("size") != size:
        return f"{path} has {size} bytes, not the size summary.json records"
    if checksums.path_entry(path).get(checksums.HASH) != recorded.get(checksums.HASH):
        return f"{path} is not the file summary.json records (its checksum differs)"
    return None
