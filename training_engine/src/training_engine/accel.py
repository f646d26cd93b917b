"""Build the Accelerator from the config: parallel mode, precision,
accumulation, trackers; and refuse the silent fallbacks accelerate allows."""

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
)
from omegaconf import DictConfig

from . import fsdp, upstream
from .config import ConfigError
from .launch import LaunchError, expected_world_size, under_launcher
from .schema import PARALLEL_MODES
from .tracking import build_trackers

log = logging.getLogger(__name__)


def build_accelerator(cfg: DictConfig, run_dir: Path) -> Accelerator:
    p = cfg.parallel
    if p.mode not in PARALLEL_MODES:
        raise ConfigError(
            f"parallel.mode={p.mode!r} is not available; choose one of {', '.join(PARALLEL_MODES)}"
        )
    if p.mode == "none" and expected_world_size(p) > 1:
        raise ConfigError(
            f"parallel=none, but the launcher started {expected_world_size(p)} processes; "
            "use parallel=ddp (or launch one process)"
        )
    on_cpu = not torch.cuda.is_available()
    handlers = []
    backend = _backend(p, on_cpu)
    if p.mode != "none":
        handlers += [
            # the timeout bounds a hung collective
            InitProcessGroupKwargs(backend=backend, timeout=timedelta(seconds=p.timeout_s)),
            DistributedDataParallelKwargs(find_unused_parameters=p.find_unused_parameters),
        ]
    precision, why = resolve_precision(cfg.trainer.mixed_precision, on_cpu)
    fsdp_plugin = _fsdp_plugin(p, on_cpu, precision) if p.mode == "fsdp" else None
    deepspeed_plugin = _deepspeed_plugin(cfg) if p.mode == "deepspeed" else None
    one_process = not under_launcher() and expected_world_size(p) == 1
    if (fsdp_plugin or deepspeed_plugin) is not None and one_process:
        # FSDP or DeepSpeed on one process (CPU offload on one GPU; a run resumed on one
        # process): fully_shard, DCP and DeepSpeed's engine need a process group, which
        # accelerate makes for 2+ only. Ours, then: accelerate, given no backend, sees
        # one process of rank 0.
        fsdp.one_process_group(backend, p.timeout_s)
        handlers = handlers[1:]
        if deepspeed_plugin is not None:  # DeepSpeed's engine asks for a launcher's variable
            os.environ.setdefault("LOCAL_RANK", "0")
    accelerator = Accelerator(
        # Without cpu=True on a machine without GPUs, accelerate ignores the
        # launcher and every process becomes an independent rank 0. DeepSpeed is
        # the exception: accelerate skips it under cpu=True, and DeepSpeed
        # brings its own (gloo) process group on a CPU.
        cpu=on_cpu and p.mode != "deepspeed",
        mixed_precision=precision,
        gradient_accumulation_steps=cfg.trainer.grad_accum_steps,
        log_with=build_trackers(cfg, run_dir) or None,
        project_dir=str(run_dir),
        kwargs_handlers=handlers,
        fsdp_plugin=fsdp_plugin,
        deepspeed_plugin=deepspeed_plugin,
        # train.py steps the scheduler once per optimizer step itself, so the
        # schedule length is the same for any number of processes.
        step_scheduler_with_optimizer=False,
        # The shuffle order comes from a generator seeded with (seed + epoch),
        # identical on every rank and after a resume.
        # non_blocking: batches from pinned memory go to the GPU without a host sync.
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=cfg.seed, non_blocking=True
        ),
        # trainer.compile: prepare() wraps the model in torch.compile (inductor).
        dynamo_backend="inductor" if cfg.trainer.compile else "no",
    )
    if accelerator.is_main_process:  # the precision in use, whether chosen or given
        given = cfg.trainer.mixed_precision
        log.info(f"trainer.mixed_precision={given}: {precision} ({why or 'as given'})")
        if cfg.trainer.compile:
            log.info(
                "trainer.compile=true: torch.compile (inductor) compiles at the first step, "
                f"which may take minutes{' on a CPU' if on_cpu else ''}"
            )
    upstream.cache_lomo_check()  # asked on every step by accelerate's optimizer wrapper
    if p.mode != "none":
        # accelerate passes on only the InitProcessGroupKwargs that differ from its
        # defaults (backend nccl, 600 s): timeout_s=600 on gloo was dropped and
        # torch's gloo default, 1800 s, applied (measured: a stopped rank went
        # unnoticed for 1444 s). Set it on the process group itself.
        set_collective_timeout(p.timeout_s)
    if fsdp_plugin is not None and accelerator.distributed_type != DistributedType.FSDP:
        _use_fsdp_where_accelerate_does_not(accelerator, fsdp_plugin)
    wanted = {"fsdp": DistributedType.FSDP, "deepspeed": DistributedType.DEEPSPEED}.get(p.mode)
    sharded = accelerator.num_processes > 1 or p.mode == "fsdp"  # FSDP on one process too
    if wanted and sharded and accelerator.distributed_type != wanted:
        raise LaunchError(
            f"parallel.mode={p.mode!r} asked for {wanted.value} but accelerate set up "
            f"{accelerator.distributed_type.value}"
        )
    expected = expected_world_size(p)
    if accelerator.num_processes != expected:
        how = "the launcher started" if under_launcher() else "the config asks for"
        raise LaunchError(
            f"{how} {expected} processes but accelerate sees {accelerator.num_processes} "
            f"(parallel.mode={p.mode!r}); a mismatch would train {expected} independent "
            "copies. Use parallel=ddp with a launcher, or parallel=none without one."
        )
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        # accelerate would silently train in fp32 here; say so instead.
        raise ConfigError(
            "trainer.mixed_precision='fp16' needs a GPU (this run is on the CPU, where "
            "accelerate has no fp16 autocast); use 'bf16' or 'no'"
        )
    return accelerator


def collective_timeout() -> timedelta | None:
    """The timeout of the default process group's collectives (None: no group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    group = torch.distributed.group.WORLD
    device = "cuda" if torch.device("cuda") in group._device_types else "cpu"
    return group._get_backend(torch.device(device)).options._timeout


def set_collective_timeout(seconds: float) -> None:
    """Every collective of the default process group waits ``seconds`` at most."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=float(seconds)))


def resolve_precision(requested: str | bool, on_cpu: bool) -> tuple[str, str]:
    """accelerate's ``mixed_precision`` for ``trainer.mixed_precision``, and why
    when it was ``auto``: bf16 on a GPU that has it (compute capability 8.0+:
    A100, H100, L4, ...), else ``no`` (fp32; fp16 is never chosen for you, it
    needs loss scaling). The explicit values stay as they are: ``fp16`` on a
    CPU is refused below, ``bf16`` on a GPU without it by preflight."""
    if requested is False:  # YAML reads an unquoted `no` as false
        return "no", ""
    if requested != "auto":
        return requested, ""
    if on_cpu:
        return "no", "no GPU: fp32"
    name = torch.cuda.get_device_name()
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return "bf16", f"{name} supports it"
    return "no", f"{name} has no bf16: fp32"


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of every parameter and buffer of the full model, in order: equal
    on every rank (the logs show it, the tests compare it). Call on all ranks:
    FSDP shards are gathered."""
    from torch.distributed.tensor import DTensor  # here: importing it costs ~1 s of start-up

    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()  # a collective: every rank takes part
        digest.update(name.encode())
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest.update(data.numpy().tobytes())
    return digest.hexdigest()[:16]


def _backend(p: DictConfig, on_cpu: bool) -> str:
    """gloo on CPU (NCCL needs GPUs); FSDP's CPU offload on GPUs also needs gloo
    for the collectives on its CPU tensors (clip_grad_norm_ of offloaded gradients)."""
    if p.backend != "auto":
        return p.backend
    if on_cpu:
        return "gloo"
    return "cpu:gloo,cuda:nccl" if p.mode == "fsdp" and p.cpu_offload else "nccl"


def _fsdp_plugin(p: DictConfig, on_cpu: bool, precision: str) -> FullyShardedDataParallelPlugin:
    if p.cpu_offload and on_cpu:
        raise ConfigError("parallel.cpu_offload=true needs GPUs (the model is on the CPU already)")
    # The units, activation checkpointing and precision policy are applied by
    # fsdp.shard_model (its docstring says why): accelerate wraps nothing itself.
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="no_wrap",
        reshard_after_forward=p.reshard_after_forward,
        cpu_offload=p.cpu_offload,
        activation_checkpointing=False,
        mixed_precision_policy=fsdp.precision_policies(precision)[0],
        state_dict_type="SHARDED_STATE_DICT",
        cpu_ram_efficient_loading=False,
    )


def _deepspeed_plugin(cfg: DictConfig) -> DeepSpeedPlugin:
    try:
        import deepspeed  # noqa: F401  (optional: only this mode needs it)
    except ImportError:
        raise ConfigError(
            "parallel=deepspeed needs DeepSpeed, which is not installed: "
            "pip install -e '.[deepspeed]' (on a machine without CUDA: "
            "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)"
        ) from None
    if not torch.cuda.is_available():
        _no_shared_memory_all_reduce()
    p = cfg.parallel
    return DeepSpeedPlugin(
        zero_stage=p.zero_stage,
        offload_optimizer_device=p.offload_optimizer,
        offload_param_device=p.offload_params,
        gradient_accumulation_steps=cfg.trainer.grad_accum_steps,
        # DeepSpeed clips inside its step; train.py's clip_grad_norm_ is then a no-op.
        gradient_clipping=cfg.trainer.grad_clip_norm or 0.0,
        # ZeRO-3: the engine gathers the full weights (layer by layer, onto the main
        # process) for model.safetensors and every checkpoint's (full_state.model_state)
        zero3_save_16bit_model=True,
        # built whole from the seed, then partitioned: the initial model of every mode
        zero3_init_flag=p.zero3_init,
    )


def tell_deepspeed_the_micro_batch(accelerator: Accelerator, loader: Any) -> None:
    """DeepSpeed's config needs the per-process micro-batch; accelerate reads it from
    each loader's ``batch_size``, which is None for a loader built with a batch sampler
    (per_sample's exact loaders, a data function's own) and then refuses. The training
    loader's batch sampler names it (1 where batches vary: DeepSpeed only counts it)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or not plugin.is_auto("train_micro_batch_size_per_gpu"):
        return
    size = getattr(loader, "batch_size", None) or getattr(loader.batch_sampler, "batch_size", None)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = size or 1


@contextlib.contextmanager
def built_whole(accelerator: Accelerator) -> Iterator[None]:
    """The model built in full on each process (from the seed, as every other mode
    does), ZeRO-3 partitioning it afterwards (parallel.zero3_init=false). accelerate
    registers its DeepSpeed config with transformers whatever its zero3_init_flag, and
    a transformers model built while it is registered is built partitioned
    (deepspeed.zero.Init) and initialised from other draws; so it is unregistered for
    the build and registered again after."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    zero3 = plugin is not None and plugin.hf_ds_config.is_zero3()
    if not zero3 or plugin.zero3_init_flag:
        yield
        return
    try:
        from transformers.integrations import unset_hf_deepspeed_config
    except ImportError:  # no transformers: nothing registered
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def _no_shared_memory_all_reduce() -> None:
    """On a CPU, DeepSpeed's communication backend JIT-compiles its shared-memory
    all-reduce op (deepspeed_shm_comm) when it starts: measured 140 s on 2 cores for
    the first run on a machine. Only DeepSpeed's inference all-reduce uses it; training
    reduces through the gloo process group either way. Marked incompatible here (the
    dict DeepSpeed keeps for this, whose edits persist), it is never built."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _use_fsdp_where_accelerate_does_not(
    accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin
) -> None:
    """accelerate enables its FSDP plugin on accelerators with 2+ processes only,
    and would silently fall back to DDP on CPU, or to no sharding on one process.
    FSDP2 itself (``fully_shard`` on a gloo process group, DTensor parameters, DCP
    checkpoints) works on CPU and on a group of one, so we switch accelerate's
    state to FSDP explicitly: from here on prepare, clip_grad_norm_, get_state_dict
    and save_state take accelerate's own, unmodified FSDP2 code path, the one they
    take on several GPUs. Used for CPU runs, CI and one-process FSDP."""
    if torch.distributed.is_initialized():
        upstream.switch_accelerate_to_fsdp(plugin)
        if accelerator.mixed_precision != "no":  # as accelerate does on GPUs
            plugin.set_mixed_precision(accelerator.mixed_precision)
