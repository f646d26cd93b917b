"""What this project relies on that accelerate, torch, transformers and Hydra do not
promise (private names, or behaviour their docs do not state): each use is here, once,
and tests/test_upstream.py pins the behaviour it relies on, so that an upgrade that
changes one fails a test rather than a run. The callers say why they need it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def switch_accelerate_to_fsdp(plugin: Any) -> None:
    """Make accelerate's shared state FSDP (its ``PartialState``/``AcceleratorState``
    ``_shared_state``): accelerate enables its FSDP plugin on accelerators with 2+
    processes only (accel.py says why we want it on CPU and on one process)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin


def cache_lomo_check() -> None:
    """accelerate's optimizer wrapper asks importlib on every ``step()`` whether the
    optional ``lomo_optim`` package is installed (``accelerate.optimizer.
    is_lomo_available``: a search of sys.path each time). The answer cannot change
    during a run: ask once."""
    import accelerate.optimizer

    check = getattr(accelerate.optimizer, "is_lomo_available", None)
    if check is not None and not hasattr(check, "cache_info"):
        accelerate.optimizer.is_lomo_available = functools.cache(check)


def is_plain_accelerated_optimizer(optimizer: Any) -> bool:
    """accelerate's own wrapper (not a subclass such as DeepSpeed's), whose
    ``zero_grad`` does nothing but call its ``.optimizer``'s. Asked twice per step:
    the class is looked up once, not imported at each call."""
    return type(optimizer) is _accelerated_optimizer_class()


@functools.cache
def _accelerated_optimizer_class() -> type:
    from accelerate.optimizer import AcceleratedOptimizer

    return AcceleratedOptimizer


def checkpoint_wrapper(module: torch.nn.Module) -> torch.nn.Module:
    """torch's activation-checkpointing wrapper (a private module path, the one
    torchtitan and accelerate use), recomputing with the forward's RNG state."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as wrap,
    )

    return wrap(module, preserve_rng_state=True)


def consolidate_safetensors(shards: str, out_dir: str, names: list[str]) -> str:
    """DCP's consolidation of Hugging Face safetensors shards into one file, tensor by
    tensor (torch's private ``_consolidate_hf_safetensors``); returns the file's name."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    consolidate_safetensors_files(shards, out_dir, dict.fromkeys(names, 1))
    return "model-00001-of-00001.safetensors"


def no_split_modules(model: torch.nn.Module) -> set[str]:
    """A transformers model's decoder-layer classes (``_no_split_modules``: what
    accelerate and transformers themselves wrap per layer)."""
    return set(getattr(model, "_no_split_modules", None) or ())


def compiled_original(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module ``torch.compile`` wrapped (``OptimizedModule._orig_mod``), else None."""
    found = getattr(model, "_orig_mod", None)
    return found if isinstance(found, torch.nn.Module) else None


def tracker_objects(accelerator: Any) -> list[Any]:
    """The tracker objects given as ``Accelerator(log_with=...)``, before
    ``init_trackers`` starts them (``accelerator.log_with``: read, not documented)."""
    return [t for t in accelerator.log_with if not isinstance(t, str)]


def job_result(job_return: Any) -> Any:
    """What a Hydra job returned or raised (``JobReturn._return_value``: its public
    ``return_value`` raises the job's exception instead of giving it)."""
    return job_return._return_value
