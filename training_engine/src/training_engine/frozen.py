"""Models the task's step calls but never trains (``frozen_models``: a distillation
teacher, a reward model, a fixed feature extractor): built from config on every rank,
in eval mode, without gradients, on the run's device. They are not checkpointed (the
config rebuilds them: e.g. ``_target_: training_engine.inference.load_model`` with a
run dir), not averaged, not sharded and not counted in MFU. docs/own-model.md.
"""

from __future__ import annotations

from typing import Any

import torch

from .adapters import base_node
from .config import ConfigError, instantiate


def build_frozen_models(section: Any, *, device: torch.device) -> dict[str, torch.nn.Module]:
    """``frozen_models`` (name -> a model node; empty: none), each ready to call."""
    built = {}
    for name, node in (section or {}).items():
        if node is None:
            continue
        if str(name) == "model":
            raise ConfigError("frozen_models.model is not allowed: `model` is the trained one")
        # a model node copied from the trained one (${model}) names model.peft: not here
        model = instantiate(base_node(node), what=f"frozen_models.{name}")
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(
                f"frozen_models.{name}: {type(model).__name__} is not a torch.nn.Module"
            )
        built[str(name)] = model.requires_grad_(False).eval().to(device)
    return built
