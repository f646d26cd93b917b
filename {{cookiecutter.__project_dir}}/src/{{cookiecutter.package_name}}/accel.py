"""Build the Accelerator from the config: precision, accumulation, trackers."""

from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from omegaconf import DictConfig

from .config_checks import ConfigError
from .tracking import build_trackers

PARALLEL_MODES = ("none",)


def build_accelerator(cfg: DictConfig, run_dir: Path) -> Accelerator:
    if cfg.parallel.mode not in PARALLEL_MODES:
        raise ConfigError(
            f"parallel.mode={cfg.parallel.mode!r} is not available; "
            f"choose one of {', '.join(PARALLEL_MODES)}"
        )
    precision = cfg.trainer.mixed_precision
    trackers = build_trackers(cfg.tracker, run_dir)
    accelerator = Accelerator(
        # YAML reads an unquoted `no` as false.
        mixed_precision="no" if precision is False else precision,
        gradient_accumulation_steps=cfg.trainer.grad_accum_steps,
        log_with=trackers or None,
        project_dir=str(run_dir),
        # train.py steps the scheduler once per optimizer step itself, so the
        # schedule length is the same for any number of processes.
        step_scheduler_with_optimizer=False,
        # The shuffle order comes from a generator seeded with (seed + epoch),
        # identical on every rank and after a resume.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed),
    )
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        # accelerate would silently train in fp32 here; say so instead.
        raise ConfigError(
            "trainer.mixed_precision='fp16' needs a GPU (this run is on the CPU, where "
            "accelerate has no fp16 autocast); use 'bf16' or 'no'"
        )
    return accelerator
