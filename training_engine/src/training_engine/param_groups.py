"""The optimizer's parameter groups by default (task.param_groups): weight decay on the
weights of matrix multiplications (linear, convolution), none on biases, norms and
embeddings, the standard for transformers (nanoGPT keeps it on embeddings; GPT-3,
LLaMA and torchtitan's recipes do not decay them). A parameter shared by two modules
(tied embeddings) is in one group, once.
"""

from __future__ import annotations

from typing import Any

from torch import nn

# Modules whose parameters are scales and offsets, not matrices; any class named *Norm*
# (BatchNorm2d, transformers' LlamaRMSNorm, ...) counts too.
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """``[{"params": decayed}, {"params": the rest, "weight_decay": 0.0}]``; the first
    keeps the optimizer's own weight_decay. An empty group is left out (LoRA adapters
    are matrices only): torch's flattened optimizer state dict, which sharded
    checkpoints load through, fails on a group without parameters."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        exempt = (
            isinstance(module, (*NORMS, nn.Embedding)) or "norm" in type(module).__name__.lower()
        )
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            (no_decay if exempt or name.endswith("bias") or param.ndim < 2 else decay).append(param)
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]
