"""The model and optimizer state to save and to load, under every parallel
mode: as full tensors (``checkpoint.format: full``; gathered from and scattered
to FSDP shards: what DDP and single-process runs use), or, for ``sharded``
(``auto`` under FSDP), each rank's own shards (sharded.py). Both load into any
world size and parallel mode. Also the run's final ``model.safetensors``.
README: "Checkpoints and resuming".
"""

import os
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType
from safetensors.torch import save as save_safetensors
from torch.nn import DataParallel
from torch.nn.parallel import DistributedDataParallel

from . import format as fmt
from . import sharded


def take(
    layout: str, accelerator: Any, model: torch.nn.Module, optimizer: Any
) -> tuple[dict[str, Any], tuple | None, dict[str, bytes]]:
    """What a save writes, taken now on every rank: the main process's full
    tensors by file name (``full``; collectives under FSDP), or this rank's
    shards (``sharded``, for ``sharded.write_job``), and extra small files."""
    main = accelerator.is_main_process
    if layout == "sharded":
        model_sd, optim_tensors, plain = sharded.state_dicts(accelerator, model, optimizer)
        extra = {sharded.OPTIMIZER_GROUPS: sharded.optimizer_groups_bytes(plain)} if main else {}
        return {}, (model_sd, optim_tensors), extra
    state = model_state(accelerator, model), optimizer_state(accelerator, model, optimizer)
    return ({"model.safetensors": state[0], "optimizer.pt": state[1]} if main else {}), None, {}


def restore(
    layout: str,
    ckpt: Path,
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    loaded: dict[str, Any],
) -> None:
    """Load a verified checkpoint's model and optimizer (``loaded``: its parsed files)."""
    if layout == "sharded":
        sharded.load(ckpt, accelerator, model, optimizer, loaded[sharded.OPTIMIZER_GROUPS])
    else:
        load_model_and_optimizer(
            accelerator, model, optimizer, loaded["model.safetensors"], loaded["optimizer.pt"]
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
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model


def model_state(accelerator: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full model state; a collective under FSDP."""
    return accelerator.get_state_dict(plain_model(accelerator, model), unwrap=False)


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
        plain_model(accelerator, model), optimizer.optimizer, options=options
    )


def load_model_and_optimizer(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
) -> None:
    """Load full states; under FSDP every rank shards its copy."""
    plain = plain_model(accelerator, model)
    if not accelerator.is_fsdp2:
        plain.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(plain, model_state, options=options)
    set_optimizer_state_dict(plain, optimizer.optimizer, optimizer_state, options=options)


def save_final_weights(accelerator: Any, model: torch.nn.Module, run_dir: Path) -> None:
    """``run_dir/model.safetensors``: the full model in one file, every name its
    class defines (tied weights copied), written by the main process and fsynced;
    a collective under FSDP (gathered). DeepSpeed: accelerate's ``save_model``
    (ZeRO-3 gathers its own way). Not ``save_model`` otherwise: it unwraps the model
    through accelerate's ``unwrap_model`` again (see ``plain_model``)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.save_model(plain_model(accelerator, model), run_dir)
        return
    state = model_state(accelerator, model)
    if accelerator.is_main_process:  # atomic: a crash leaves the old file or none
        final = Path(run_dir) / "model.safetensors"
        tmp = final.with_name(f".{final.name}.tmp")
        fmt.write_file(tmp, save_safetensors(fmt.unshared(state), metadata={"format": "pt"}))
        os.replace(tmp, final)
        fmt.fsync_dir(final.parent)
    accelerator.wait_for_everyone()
