"""DeepSpeed's part of a checkpoint (``parallel=deepspeed``; layout ``deepspeed``).

DeepSpeed writes and reads its own files (``engine.save_checkpoint`` into
``step_N.tmp/deepspeed/``, ``engine.load_checkpoint``): the ZeRO partitions of
the optimizer (and, at stage 3, of the parameters), the fp32 master weights and
its loss scaler, each rank its own files, at any stage and with offload. The
rest of the checkpoint is ours as in every mode: the gathered ``model.safetensors``
(eval.py, predict.py, export), ``scheduler.pt``, the RNG files, the JSON files
and the manifest hashing every file, DeepSpeed's included.

Its optimizer files pickle three of DeepSpeed's own types besides tensors.
They are loaded with ``torch.load(weights_only=True)`` and exactly those three
allowed (``allowed_types``): an enum, a dataclass of two integers and the loss
scaler, rebuilt as plain attributes, never by running code from the file. Every
file a rank will load is hashed and unpickled this way before any live object
is touched (``check``), and DeepSpeed's own load runs under the same rule
(``TORCH_FORCE_WEIGHTS_ONLY_LOAD``). docs/deepspeed.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from ..files import fsync_dir
from .format import DEEPSPEED_DIR, CheckpointError, load_tensors_safely

# DeepSpeed copies its conversion scripts next to the checkpoint: code, not state.
_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def allowed_types() -> list[type]:
    """What DeepSpeed's own files name besides tensors and containers (found with
    torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO-2 and ZeRO-3
    checkpoints, fp32, with and without optimizer offload): nothing else loads."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, fragment_address, LossScaler]


@contextlib.contextmanager
def weights_only() -> Iterator[None]:
    """Every ``torch.load`` inside (DeepSpeed's too, which asks for
    ``weights_only=False``) loads weights only, with ``allowed_types`` besides."""
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(allowed_types()):
            yield
    finally:
        if before is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before


def is_own(name: str) -> bool:
    return name.startswith(f"{DEEPSPEED_DIR}/")


def loaded_by(name: str, rank: int) -> bool:
    """Whether rank ``rank`` reads DeepSpeed's file ``name`` on resume at the same
    world size: its own partitions (``zero_pp_rank_<rank>_...``) and the files
    of every rank (ZeRO-1/2's ``mp_rank_00_model_states.pt``)."""
    base = name.removeprefix(f"{DEEPSPEED_DIR}/")
    return f"zero_pp_rank_{rank}_" in base or "zero_pp_rank_" not in base  # bf16_zero_pp_...


def check(path: Path) -> None:
    """Unpickled with weights only and ``allowed_types``; anything else is refused here,
    before DeepSpeed opens it (the result is dropped: DeepSpeed loads it itself)."""
    with torch.serialization.safe_globals(allowed_types()):
        load_tensors_safely(path, str(path))


def write(tmp: Path, engine: Any, rank: int) -> list[Path]:
    """Every rank: DeepSpeed writes its files into ``tmp/deepspeed`` (collectives);
    each rank fsyncs the files that are its own and returns them (save.py hashes
    them). The main process also removes the scripts DeepSpeed copies beside them."""
    engine.save_checkpoint(str(tmp), tag=DEEPSPEED_DIR, client_state={}, save_latest=False)
    folder = tmp / DEEPSPEED_DIR
    mine = sorted(p for p in folder.iterdir() if writes(p.name, rank))
    for path in mine:
        with open(path, "rb") as f:  # DeepSpeed's torch.save does not fsync
            os.fsync(f.fileno())
    if rank == 0:
        fsync_dir(folder)
        for script in _SCRIPTS:
            (tmp / script).unlink(missing_ok=True)
    return mine


def writes(name: str, rank: int) -> bool:
    """Which rank owns (fsyncs, hashes) a file: its partitions; rank 0 the shared ones."""
    partition = "zero_pp_rank_" in name  # bf16_zero_pp_rank_... too
    return f"zero_pp_rank_{rank}_" in name or (rank == 0 and not partition)


def write_job(job: Any, failed: Exception | None, engine: Any, rank: int) -> Exception | None:
    """``sharded.write_job`` for DeepSpeed: every rank writes (main thread), then
    notes its files in ``job.own_files``. Returns the first error instead of raising."""
    if failed is not None:
        return failed
    if not job.tmp.is_dir():  # the main process failed to make it: every rank skips
        return FileNotFoundError(2, "not created", str(job.tmp))
    try:
        job.own_files = write(job.tmp, engine, rank)
    except OSError as err:
        return err
    return None


def load(ckpt: Path, engine: Any) -> None:
    """Restore DeepSpeed's state (model, optimizer partitions, loss scaler) from
    ``ckpt/deepspeed``, weights only (``weights_only``); the scheduler and the RNG
    are ours (manager.py). The same world size only (``check_resumable``)."""
    with weights_only():
        path, _ = engine.load_checkpoint(
            str(ckpt),
            tag=DEEPSPEED_DIR,
            load_module_strict=True,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
    if path is None:
        raise CheckpointError(f"{ckpt}: DeepSpeed found no checkpoint in {DEEPSPEED_DIR}/")


def check_resumable(ckpt: Path, manifest: dict[str, Any], accelerator: Any) -> None:
    """ConfigError (exit 2, before any work) unless this run can load ``ckpt``:
    DeepSpeed's files need DeepSpeed on the world size that wrote them, and
    DeepSpeed loads no other layout's optimizer."""
    from accelerate.utils import DistributedType

    saved_world, world = int(manifest.get("world_size", 1)), accelerator.num_processes
    layout = manifest.get("layout", "full")
    running = getattr(accelerator, "distributed_type", None) == DistributedType.DEEPSPEED
    if running != (layout == "deepspeed"):
        raise ConfigError(
            f"{ckpt} has the {layout} layout (parallel="
            f"{'deepspeed' if layout == 'deepspeed' else 'none, ddp or fsdp'}); this run "
            f"{'uses' if running else 'does not use'} parallel=deepspeed, whose optimizer "
            "state is DeepSpeed's own: resume with the parallel mode that saved it, or "
            "start a new run from its weights (checkpoint.init_from)"
        )
    if running and saved_world != world:
        raise ConfigError(
            f"{ckpt} was saved by parallel=deepspeed with {saved_world} processes; this "
            f"run has {world}. DeepSpeed's ZeRO partitions resume on {saved_world} "
            f"processes only: relaunch with {saved_world} (parallel.num_processes / "
            "parallel.num_nodes), or start a new run (another run_name)"
        )
