"""A trained run's model outside training: which checkpoint a path names, its
weights loaded safely (hash-verified, no unpickling), the model rebuilt from the
run's own config (``load_model``), and the config eval.py/predict.py run with
(the run's model, data and precision, plus the command line's overrides).
README: "Evaluate, predict, load a model".

    from {{ cookiecutter.package_name }}.engine.inference import load_model
    model = load_model("runs/exp1")                  # best checkpoint, eval mode
    model = load_model("runs/exp1", weights="ema")   # the EMA weights (trainer.ema)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from .checkpoint import folder, ties
from .checkpoint import format as fmt
from .checkpoint.format import CheckpointError
from .config import ConfigError, instantiate, require

PICKS = ("best", "latest")
WEIGHTS = ("raw", "ema")
EMA_FILE = "ema.safetensors"  # the ``ema`` stateful extra (ema.py), saved as tensors
# What eval.py/predict.py take from the trained run's config (so the model and
# data match what was trained); everything else comes from their own config.
FROM_RUN = ("model", "data", "seed", "deterministic", "trainer.mixed_precision", "trainer.compile")


@dataclass
class Loaded:
    """A model with its checkpoint's weights, and where they came from."""

    model: torch.nn.Module
    checkpoint: Path
    step: int
    weights: str
    config: dict[str, Any]  # the training run's resolved config (config.json)


def check_choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    require(key, value, value in allowed, "one of " + ", ".join(allowed))


def resolve_checkpoint(path: str | Path, pick: str = "best") -> Path:
    """The checkpoint a path names: one ``step_*`` dir as is; a run dir (or its
    ``checkpoints/``): the best one (``best.json``) or the newest (``latest``)."""
    check_choice("pick", pick, PICKS)
    path = Path(path).expanduser().resolve()
    found = folder.find_checkpoints(path)  # CheckpointError: no such path, or a *.tmp
    if len(found) == 1 and (folder.step_of(path) is not None or (path / fmt.MANIFEST).exists()):
        return found[0]
    if not found:
        raise CheckpointError(
            f"{path}: no checkpoint there (a run dir with checkpoints/step_*, or one step_* dir)"
        )
    root = found[-1].parent
    if pick == "latest":
        return found[-1]
    pointer = root / "best.json"
    if not pointer.is_file():
        raise CheckpointError(
            f"{path}: no best checkpoint ({pointer} is missing: trained with "
            "checkpoint.save_best.enabled=false?); use pick=latest (eval.py: ckpt_pick=latest)"
        )
    best = root / json.loads(pointer.read_text(encoding="utf-8"))["path"]
    if not best.is_dir():
        raise CheckpointError(f"{pointer} names {best}, which is gone (pruned by hand?)")
    return best


def read_weights(ckpt: Path, weights: str = "raw") -> tuple[dict[str, torch.Tensor], dict]:
    """(model state dict, the run's config) of one checkpoint, every file read
    verified against its manifest. ``weights=ema``: the EMA weights."""
    check_choice("weights", weights, WEIGHTS)
    manifest = fmt.read_manifest(ckpt)
    name = "model.safetensors" if weights == "raw" else EMA_FILE
    if name not in manifest["files"]:
        raise CheckpointError(
            f"{ckpt} holds no EMA weights (trained without trainer.ema.enabled=true): "
            "use weights=raw"
        )
    loaded = fmt.verify_files(ckpt, [name, "config.json", ties.TIES_FILE], parse=fmt.parse_file)
    state = ties.restore(loaded[name], ties.of_checkpoint(loaded, ckpt))  # tied: stored once
    if weights == "ema":  # torch.optim.swa_utils.AveragedModel's keys: module.* + n_averaged
        state = {k.removeprefix("module."): v for k, v in state.items() if k != "n_averaged"}
    return state, loaded["config.json"]


def load_checkpoint(
    path: str | Path, pick: str = "best", weights: str = "raw", model_config: Any = None
) -> Loaded:
    """The model of ``model_config`` (default: the run's own) with a checkpoint's
    weights, on the CPU, in eval mode; strict: every key and shape must match."""
    ckpt = resolve_checkpoint(path, pick)
    state, config = read_weights(ckpt, weights)
    node = OmegaConf.create(config["model"] if model_config is None else model_config)
    model = instantiate(node, what="model")
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ConfigError(
            f"{ckpt}: the weights do not fit the model {node._target_}: {err}"
        ) from err
    step = int(fmt.read_manifest(ckpt)["step"])
    return Loaded(model.eval(), ckpt, step, weights, config)


def load_model(path: str | Path, pick: str = "best", weights: str = "raw") -> torch.nn.Module:
    """The eager ``nn.Module`` of a trained run, weights loaded, in eval mode.

    ``path``: a run dir (``pick``: its best or latest checkpoint) or one
    ``step_*`` dir; ``weights``: ``raw`` or ``ema`` (trainer.ema's average)."""
    return load_checkpoint(path, pick, weights).model


def run_config(saved: dict, composed: DictConfig, overrides: list[str]) -> DictConfig:
    """The config eval.py/predict.py run with: ``composed`` (their own, resolved)
    with FROM_RUN taken (replaced whole) from the trained run's ``saved`` config, then the command
    line's ``overrides`` of those keys applied again (``data.val_batch_size=64``,
    ``data=tokens``): Hydra composed and checked them in ``composed``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cfg = OmegaConf.create(OmegaConf.to_container(composed, resolve=True))
    run = OmegaConf.create(saved)
    for key in FROM_RUN:
        if OmegaConf.select(run, key, default="<absent>") != "<absent>":
            OmegaConf.update(cfg, key, OmegaConf.select(run, key), merge=False, force_add=True)
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in FROM_RUN):
            value = OmegaConf.select(composed, key)
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    OmegaConf.set_struct(cfg, True)
    return cfg


def run_values(config: Any) -> dict[str, Any]:
    """The FROM_RUN values of a config (for eval.json's differences)."""
    node = OmegaConf.create(config)
    values = {key: OmegaConf.select(node, key, default=None) for key in FROM_RUN}
    return OmegaConf.to_container(OmegaConf.create(values))
