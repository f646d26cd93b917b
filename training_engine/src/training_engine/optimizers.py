"""Several optimizers as one (torchtitan's ``OptimizersContainer``): the run's
``optimizer`` plus the ones named under ``optimizers`` (e.g. Muon for the matrices
and AdamW for the rest, or a GAN's discriminator), each over the parameter groups the
task's ``param_groups`` gives its name. To accelerate, the schedule, the checkpoint
and preflight it is one optimizer: ``step``/``zero_grad`` act on all, its
``param_groups`` are every optimizer's own group dicts (a schedule scales each
group's learning rate, so each optimizer keeps its own), and its state dict holds each
one's by name. The task's step updates one of them by name (``Step.update(name)``).

Under FSDP the full and sharded checkpoints use torch's state-dict API, which takes a
list of optimizers over one model (``inner_optimizers``). DeepSpeed has one optimizer
per engine: several are refused there (config.py).
"""

from __future__ import annotations

from typing import Any

import torch

from .config import ConfigError, instantiate_partial

PRIMARY = "optimizer"  # the name of ``cfg.optimizer``


class NamedOptimizers(torch.optim.Optimizer):
    """Optimizers by name, acting as one. ``Optimizer.__init__`` is not called: the
    groups and the state are the members' own objects, not copies."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        self.optimizers = dict(optimizers)
        self.defaults: dict[str, Any] = {}
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self._optimizer_state_dict_pre_hooks: dict = {}
        self._optimizer_state_dict_post_hooks: dict = {}
        self._optimizer_load_state_dict_pre_hooks: dict = {}
        self._optimizer_load_state_dict_post_hooks: dict = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        """accelerate's FSDP2 path replaces each group's ``params`` in place; a new
        list of the same length is taken group by group."""
        current = self.param_groups
        if len(groups) != len(current):
            raise ValueError("NamedOptimizers: a different number of parameter groups")
        for mine, theirs in zip(current, groups, strict=True):
            if mine is not theirs:
                mine.update(theirs)

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        merged: dict[Any, Any] = {}
        for opt in self.optimizers.values():
            merged.update(opt.state)
        return merged

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != set(self.optimizers):
            raise ValueError(
                f"the saved optimizers are {sorted(state_dict)}, "
                f"this run's {sorted(self.optimizers)}"
            )
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[name])

    def __repr__(self) -> str:
        return f"NamedOptimizers({', '.join(self.optimizers)})"


def build_optimizers(primary: Any, named: Any, groups: Any) -> torch.optim.Optimizer:
    """The run's optimizer: ``primary`` (cfg.optimizer, a partial) over ``groups`` (the
    task's ``param_groups``) when ``named`` (cfg.optimizers) is empty; else every one of
    them, ``optimizer`` included, over the groups the task gives its name."""
    named = {str(k): v for k, v in (named or {}).items() if v is not None}
    if not named:
        if isinstance(groups, dict):
            raise ConfigError(
                f"the task's param_groups gave groups for {sorted(groups)}, but only one "
                "optimizer is configured: name the others under optimizers (e.g. "
                "+optimizers.muon._target_=...) or return one list of groups"
            )
        return instantiate_partial(primary, "optimizer", groups)
    names = [PRIMARY, *named]
    if not isinstance(groups, dict) or set(groups) != set(names):
        given = sorted(groups) if isinstance(groups, dict) else "one list"
        raise ConfigError(
            f"optimizers: {', '.join(names)} are configured, but the task's param_groups "
            f"gave {given}: return a dict of parameter groups by optimizer name "
            "(docs/own-model.md, 'Several optimizers')"
        )
    nodes = {PRIMARY: primary, **named}
    return NamedOptimizers(
        {
            name: instantiate_partial(nodes[name], f"optimizers.{name}", groups[name])
            for name in names
        }
    )


def inner_optimizers(optimizer: Any) -> Any:
    """What torch's state-dict API takes: the plain optimizer, or the list of them."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    return list(inner.optimizers.values()) if isinstance(inner, NamedOptimizers) else inner


def by_name(optimizer: Any) -> dict[str, Any]:
    """The optimizers a task's step updates by name: each of several, or the one
    (through accelerate's wrapper) as ``optimizer``."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return dict(inner.optimizers) if isinstance(inner, NamedOptimizers) else {PRIMARY: optimizer}
