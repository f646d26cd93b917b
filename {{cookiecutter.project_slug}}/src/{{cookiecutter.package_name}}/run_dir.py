"""The run directory: Hydra's output dir, shared by every rank of a run.

It holds Hydra's own ``.hydra/`` (unresolved), the resolved ``config.yaml`` and
``config.json``, ``train.log``, ``metrics.csv``, ``checkpoints/`` (see
``checkpoint.py``) and, at the end, ``summary.json`` and ``model.safetensors``.
A fixed ``run_name`` makes it stable, so rerunning a command resumes there.
Only the main process writes here; the functions check that themselves.
"""

import json
import os
from pathlib import Path
from typing import Any

from accelerate import PartialState
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf


def hydra_run_dir() -> Path:
    """The output directory Hydra created for this job (run or multirun)."""
    return Path(HydraConfig.get().runtime.output_dir)


def resolve_config(cfg: DictConfig) -> DictConfig:
    """A fully resolved copy with no ``${...}`` left and no link to Hydra, in
    struct mode so a typo in a key still fails loudly."""
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    resolved = OmegaConf.create(container)
    OmegaConf.set_struct(resolved, True)
    return resolved


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so that readers see the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_resolved_config(cfg: DictConfig, run_dir: Path) -> None:
    """``config.yaml`` and ``config.json`` beside Hydra's ``.hydra/``."""
    if not PartialState().is_main_process:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True), encoding="utf-8")
    write_json_atomic(run_dir / "config.json", OmegaConf.to_container(cfg, resolve=True))


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    if PartialState().is_main_process:
        write_json_atomic(run_dir / "summary.json", summary)
