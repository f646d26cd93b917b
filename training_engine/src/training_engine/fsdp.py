"""FSDP2 units (``parallel=fsdp``): which submodules get a ``fully_shard`` unit
of their own, activation checkpointing and mixed precision per unit, then the
root (torchtitan's recipe); and the process group of a one-process FSDP run.
docs/parallel.md.

The units below the root come from the first rule that finds any:

1. ``parallel.wrap_classes``: the classes named there (e.g. ``[Block, GPT2Block]``);
2. a Hugging Face model's own ``_no_split_modules`` (its decoder layers);
3. repeated blocks: the children of a ``ModuleList``/``Sequential`` that are all
   one class, at least 2 (the outermost such list: ``model=gpt``'s ``blocks``);
4. size: every submodule with a ``forward`` and at least
   ``parallel.auto_wrap_min_params`` parameters (a model without repeated blocks).

A unit is never a container without a ``forward`` (``fully_shard`` refuses a
``ModuleList``) and never splits tied parameters (FSDP2 refuses a parameter in two
units: a GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``, both in the root).

Why here and not through accelerate's wrapping: accelerate 1.15's FSDP2 policies are
by class name or by size; its size policy hands ``ModuleList`` containers to
``fully_shard`` (the crash of ``model=gpt``), and its activation checkpointing
recomputes without the RNG state (dropout masks would differ in the recompute).
So the model is sharded here, before the optimizer is built (torchtitan's order);
``accelerator.prepare`` then sees an ``FSDPModule``, skips its own wrapping
(``fsdp2_prepare_model`` returns such a model as it is) and keeps the rest of its
FSDP2 path: the optimizer's parameters, ``clip_grad_norm_``, the state dicts.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from . import upstream
from .checkpoint import ties
from .config import ConfigError

log = logging.getLogger(__name__)

LISTS = (nn.ModuleList, nn.Sequential)


@dataclass
class Plan:
    """The units below the root (module names, outermost first) and why."""

    units: list[str]
    rule: str
    skipped: list[str] = field(default_factory=list)  # not made units, with the reason


def has_forward(module: nn.Module) -> bool:
    """False for containers (``ModuleList``, ``ModuleDict``): ``fully_shard`` needs
    a forward to gather the unit's parameters before it runs."""
    return type(module).forward is not nn.Module.forward


def tie_groups(model: nn.Module) -> list[list[str]]:
    """Names that share one parameter (2 or more each; checkpoint/ties.py finds them)."""
    groups: dict[str, list[str]] = {}
    for alias, kept in ties.find(model).items():
        groups.setdefault(kept, [kept]).append(alias)
    return list(groups.values())


def _inside(name: str, prefix: str) -> bool:
    return name.startswith(prefix + ".")


def splits_a_tie(prefix: str, ties: list[list[str]]) -> list[str] | None:
    """The tie a unit at ``prefix`` would cut (some of its names inside, some out)."""
    for group in ties:
        inside = [n for n in group if _inside(n, prefix)]
        if inside and len(inside) < len(group):
            return group
    return None


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _outermost(names: list[str]) -> list[str]:
    return [n for n in names if not any(_inside(n, other) for other in names if other != n)]


def _by_class(model: nn.Module, classes: set[str]) -> list[str]:
    return [n for n, m in model.named_modules() if n and type(m).__name__ in classes]


def _repeated_blocks(model: nn.Module) -> list[str]:
    """The children of every outermost ``ModuleList``/``Sequential`` whose
    children are all one class with a forward and parameters (2 or more)."""
    found: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        children = list(module.named_children())
        kinds = {type(child) for _, child in children}
        if (
            isinstance(module, LISTS)
            and len(children) >= 2
            and len(kinds) == 1
            and has_forward(children[0][1])
            and all(_param_count(child) for _, child in children)
        ):
            found.extend(f"{prefix}{name}" for name, _ in children)
            return  # the blocks' insides are theirs
        for name, child in children:
            visit(f"{prefix}{name}.", child)

    visit("", model)
    return found


def _by_size(model: nn.Module, min_params: int, ties: list[list[str]]) -> list[str]:
    """Bottom-up, as FSDP1's size policy: a submodule with a forward becomes a unit
    when the parameters not already in units inside it number ``min_params`` or
    more (a container's are counted in the module around it)."""
    chosen: list[str] = []

    def left(prefix: str, module: nn.Module) -> int:
        count = sum(p.numel() for p in module.parameters(recurse=False))
        count += sum(left(f"{prefix}{n}.", child) for n, child in module.named_children())
        name = prefix.rstrip(".")
        big = name and count >= min_params and has_forward(module)
        if big and splits_a_tie(name, ties) is None:
            chosen.append(name)
            return 0
        return count

    left("", model)
    return sorted(chosen, key=list(dict(model.named_modules())).index)  # outermost first


def _no_split_classes(model: nn.Module) -> set[str]:
    return upstream.no_split_modules(model)


def plan_units(model: nn.Module, *, wrap_classes: list[str] | None, min_params: int) -> Plan:
    """Which submodules become FSDP units (module docstring's rules). Pure: the
    model is only read. Raises ConfigError for a ``wrap_classes`` entry that
    names no class of the model, or a container."""
    modules = dict(model.named_modules())
    ties = tie_groups(model)
    if wrap_classes:
        present = {type(m).__name__: m for n, m in modules.items() if n}
        unknown = [c for c in wrap_classes if c not in present]
        containers = [c for c in wrap_classes if c in present and not has_forward(present[c])]
        if unknown or containers:
            repeated = Counter(type(m).__name__ for n, m in modules.items() if n and has_forward(m))
            classes = ", ".join(f"{c} ({k})" for c, k in repeated.most_common() if k > 1)
            what = (
                f"{', '.join(unknown)} is not a class of {type(model).__name__}"
                if unknown
                else f"{', '.join(containers)} has no forward (a container: name its "
                "children's class)"
            )
            raise ConfigError(
                f"parallel.wrap_classes={list(wrap_classes)} is not allowed: {what}; "
                f"expected class names of its submodules with a forward, e.g. its repeated "
                f"ones: {classes or 'none'}"
            )
        names, rule = _by_class(model, set(wrap_classes)), "parallel.wrap_classes"
    else:
        names, rule = [], ""
        hf = _no_split_classes(model)
        if hf:
            names = _by_class(model, hf)
            rule = f"{type(model).__name__}._no_split_modules"
        if not names:
            names, rule = _repeated_blocks(model), "repeated blocks"
        if not names:
            names = _by_size(model, min_params, ties)
            rule = f"size: modules with >= {min_params} parameters (parallel.auto_wrap_min_params)"
    units, skipped = [], []
    for name in names:
        tie = splits_a_tie(name, ties)
        if tie is not None:
            skipped.append(f"{name} (tied: {' = '.join(tie)})")
        elif not has_forward(modules[name]):
            skipped.append(f"{name} (no forward)")
        else:
            units.append(name)
    # A unit whose parameters all sit in units inside it would be an empty one.
    units = [u for u in units if _own_params(modules[u], u, units)]
    return Plan(units=units, rule=rule, skipped=skipped)


def _own_params(module: nn.Module, name: str, units: list[str]) -> bool:
    inner = [u.removeprefix(name + ".") for u in units if _inside(u, name)]
    return any(
        not any(p == u or p.startswith(u + ".") for u in inner)
        for p, _ in module.named_parameters()
    )


def describe(model: nn.Module, units: list[str]) -> str:
    """``4 x Block + root``: the units' classes in order of appearance."""
    modules = dict(model.named_modules())
    counts = Counter(type(modules[u]).__name__ for u in units)
    parts = [f"{k} x {cls}" for cls, k in counts.items()]
    return " + ".join([*parts, "root"]) if parts else "root only"


def precision_policies(mixed_precision: str) -> tuple[Any, Any]:
    """(per-block policy, root policy): under bf16/fp16 the gathered parameters
    compute in that dtype and the gradients are reduced in fp32 (torchtitan's
    default); the root hands fp32 outputs to the loss. Otherwise fp32 throughout.
    On a CPU the same policy runs (gloo reduces fp32): correct, but few CPUs are
    faster in bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(mixed_precision))
    if dtype is None:
        return MixedPrecisionPolicy(), MixedPrecisionPolicy()
    block = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=torch.float32
    )
    return block, root


def shard_model(model: nn.Module, *, accelerator: Any, parallel: Any) -> nn.Module:
    """Under FSDP2: activation checkpointing and ``fully_shard`` per unit (outermost
    units checkpointed), then the root; logs the units. Call on every rank, before
    the optimizer is built. Any other mode: the model as it is."""
    if not getattr(accelerator, "is_fsdp2", False):
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    wrap_classes = parallel.wrap_classes
    plan = plan_units(
        model,
        wrap_classes=list(wrap_classes) if wrap_classes else None,
        min_params=parallel.auto_wrap_min_params,
    )
    for skipped in plan.skipped:
        log.warning(f"FSDP: {skipped} is not a unit of its own (it stays in the one around it)")
    label = describe(model, plan.units)
    block_mp, root_mp = precision_policies(accelerator.mixed_precision)
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    common = {
        "mesh": mesh,
        "offload_policy": CPUOffloadPolicy() if parallel.cpu_offload else OffloadPolicy(),
    }
    checkpointed = parallel.activation_checkpointing and _outermost(plan.units)
    for name in reversed(plan.units):  # inner units first: FSDP2 shards bottom-up
        unit = model.get_submodule(name)
        if checkpointed and name in checkpointed:
            # torch's wrapper (as torchtitan's and accelerate's); preserve_rng_state:
            # the recompute draws the same dropout masks as the forward did.
            unit = upstream.checkpoint_wrapper(unit)
            model.set_submodule(name, unit)
        fully_shard(
            unit,
            reshard_after_forward=bool(parallel.reshard_after_forward),
            mp_policy=block_mp,
            **common,
        )
    fully_shard(model, mp_policy=root_mp, **common)  # the root: everything left
    if parallel.activation_checkpointing and not plan.units:
        log.warning(
            "parallel.activation_checkpointing=true, but the model has no blocks to "
            "checkpoint (FSDP units: root only): nothing is recomputed"
        )
    log.info(
        f"FSDP units: {label} ({plan.rule}; activation checkpointing "
        f"{'on' if checkpointed else 'off'}; params {_dtype(block_mp.param_dtype)}, "
        f"gradients reduced in {_dtype(block_mp.reduce_dtype)}; reshard_after_forward="
        f"{bool(parallel.reshard_after_forward)}; cpu_offload={bool(parallel.cpu_offload)})"
    )
    return model


def _dtype(dtype: torch.dtype | None) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def one_process_group(backend: str, timeout_s: float) -> None:
    """A process group of one (rank 0 of 1, an in-memory store: no port, no
    environment variables), so that ``fully_shard`` and DCP run in a single
    process: FSDP with CPU offload on one GPU, or a run resumed on one process."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout_s)
    )
