"""The model and optimizer state as full tensors, to save and to load, under
every parallel mode (gathered from and scattered to FSDP shards).

Under FSDP a checkpoint holds the full state, not DCP shards: DCP's metadata
file is a pickle, which safe loading refuses to unpickle. Full state also loads
into any world size and exports as is. README: "Checkpoints and resuming".
"""

from typing import Any

import torch


def plain_model(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    """The model without DDP's and torch.compile's wrappers: the parameter
    names its class defines, with or without ``trainer.compile``."""
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def model_state(accelerator: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full model state; a collective under FSDP."""
    return accelerator.get_state_dict(plain_model(accelerator, model))


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
