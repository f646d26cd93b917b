"""The run directory: Hydra's output dir, shared by every rank of a run.

It holds Hydra's own ``.hydra/`` (unresolved), the resolved ``config.yaml`` and
``config.json``, ``train.log``, ``metrics.csv``, ``checkpoints/`` (see
``checkpoint/``) and, at the end, ``summary.json`` and ``model.safetensors``.
A fixed ``run_name`` makes it stable, so rerunning a command resumes there.
Only the main process writes here; the functions check that themselves.
"""

import json
import os
import time
from pathlib import Path
from typing import Any

from accelerate import PartialState
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .launch import global_rank, under_launcher


def default_run_name() -> str:
    """The default ``run_name``: the same on every rank of a run.

    ``${now:}`` would be resolved by each process of an external launcher at a
    slightly different time, giving one run dir per rank. Instead: the SLURM job
    id (also stable across a requeue), else the start time of the launcher
    process (the parent of every local rank under torchrun/accelerate launch),
    else this process's own start time.
    """
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if job:
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm-{job}" + (f"_{task}" if task and "SLURM_ARRAY_JOB_ID" in os.environ else "")
    pid = os.getppid() if under_launcher() else os.getpid()
    started = _process_start_time(pid) or time.time()
    return time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(started))


def _process_start_time(pid: int) -> float | None:
    """Seconds since the epoch when ``pid`` started (Linux /proc), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def hydra_run_dir() -> Path:
    """The output directory Hydra created for this job (run or multirun)."""
    return Path(HydraConfig.get().runtime.output_dir)


def write_text_atomic(path: Path, text: str) -> None:
    """Write a file so that readers see the old one or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def in_sweep() -> bool:
    """True inside a job of ``python train.py -m ...``."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def save_resolved_config(cfg: DictConfig, run_dir: Path) -> None:
    """``config.yaml`` and ``config.json`` beside Hydra's ``.hydra/``."""
    # No process group exists yet: the launcher's env (or node_rank when this
    # process will spawn the workers of one node) says who writes.
    if global_rank() != 0 or cfg.parallel.get("node_rank", 0) != 0:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True), encoding="utf-8")
    write_json_atomic(run_dir / "config.json", OmegaConf.to_container(cfg, resolve=True))


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    if PartialState().is_main_process:
        write_json_atomic(run_dir / "summary.json", summary)
