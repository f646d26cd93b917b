"""Build the Accelerator from the config: parallel mode, precision,
accumulation, trackers; and refuse the silent fallbacks accelerate allows."""

import hashlib
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    InitProcessGroupKwargs,
)
from omegaconf import DictConfig

from .config_checks import ConfigError
from .launch import LaunchError, expected_world_size, under_launcher
from .tracking import build_trackers

PARALLEL_MODES = ("none", "ddp")


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
    if p.mode != "none":
        handlers += [
            # gloo on CPU (NCCL needs GPUs); the timeout bounds a hung collective.
            InitProcessGroupKwargs(
                backend=(p.backend if p.backend != "auto" else ("gloo" if on_cpu else "nccl")),
                timeout=timedelta(seconds=p.timeout_s),
            ),
            DistributedDataParallelKwargs(find_unused_parameters=p.find_unused_parameters),
        ]
    precision = cfg.trainer.mixed_precision
    accelerator = Accelerator(
        # Without cpu=True on a machine without GPUs, accelerate ignores the
        # launcher and every process becomes an independent rank 0.
        cpu=on_cpu,
        # YAML reads an unquoted `no` as false.
        mixed_precision="no" if precision is False else precision,
        gradient_accumulation_steps=cfg.trainer.grad_accum_steps,
        log_with=build_trackers(cfg.tracker, run_dir) or None,
        project_dir=str(run_dir),
        kwargs_handlers=handlers,
        # train.py steps the scheduler once per optimizer step itself, so the
        # schedule length is the same for any number of processes.
        step_scheduler_with_optimizer=False,
        # The shuffle order comes from a generator seeded with (seed + epoch),
        # identical on every rank and after a resume.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed),
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


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of every parameter and buffer, in order: equal on every rank
    of a data-parallel run (the logs show it, the tests compare it)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(
            tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    return digest.hexdigest()[:16]
