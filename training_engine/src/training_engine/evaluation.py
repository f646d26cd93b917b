"""eval.py's and predict.py's work, on every rank: a checkpoint's model through the
run's task (built from its config) over the data's splits; ``eval.json`` (metrics,
checkpoint, step, the config's differences from the training run) and
``predictions.csv`` (one row per sample, in dataset order, gathered across ranks
without the distributed sampler's padding). docs/lifecycle.md.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from .accel import build_accelerator
from .checkpoint import CheckpointError
from .checkpoint import format as fmt
from .classes import read_classes, run_dir_of
from .config import (
    ConfigError,
    check_config,
    config_differences,
    instantiate,
    require,
    resolve_config,
)
from .data_files import read_files
from .files import write_json_atomic
from .inference import (
    BUILT_FROM_RUN,
    PICKS,
    WEIGHTS,
    check_choice,
    load_checkpoint,
    model_spec,
    read_first_valid,
    run_config,
    run_values,
    trusted_config,
)
from .launch import LaunchError, run
from .loaders import in_dataset_order
from .logs import setup_rank_logging
from .per_sample import exact_loader
from .run_dir import hydra_run_dir, made_by_this_launch
from .task import build_task

log = logging.getLogger(__name__)
SPLITS = ("val", "test", "train")  # loader attributes of the data module's result


def main(raw: DictConfig, work: Callable[[DictConfig, Path], Any]) -> None:
    """eval.py's and predict.py's body: check and prepare, then ``work``
    (``evaluate`` or ``predict``) here or in N spawned workers. A known error is
    one log line and its exit code (2: bad config, 1: a failure)."""
    try:
        cfg, out_dir = prepare(raw)
        run(work, cfg, out_dir)
    except (ConfigError, LaunchError, CheckpointError) as err:
        log.error(str(err))
        sys.exit(err.exit_code)


def prepare(raw: DictConfig) -> tuple[DictConfig, Path]:
    """The config to run with (the checkpoint's run config + overrides), checked
    before any work, and the output dir. eval.py and predict.py call it first.
    On bad input the (empty) output dir Hydra made is removed again."""
    out_dir = hydra_run_dir()
    try:
        composed = resolve_config(raw)
        check_choice("ckpt_pick", composed.ckpt_pick, PICKS)
        check_choice("weights", composed.weights, WEIGHTS)
        check_choice("split", composed.split, SPLITS)
        found = Path(composed.ckpt).exists()
        require("ckpt", composed.ckpt, found, "a run dir, its checkpoints/ or a step_* dir")
        # the first valid checkpoint (verified: a corrupt one is skipped, as resume does)
        # (its weights judged against the run's model, built on the meta device: a
        # checkpoint whose weights do not fit it is skipped for the previous one)
        ckpt, _, saved = read_first_valid(
            composed.ckpt,
            composed.ckpt_pick,
            composed.weights,
            lambda run: model_spec(
                trusted_config(
                    run, ("model",), trusted=composed.trusted_targets, where="config.json"
                )["model"]
            ),
        )
        # the run's model and data are built only from targets this project trusts
        where = str(ckpt / fmt.CONFIG)
        saved = trusted_config(saved, BUILT_FROM_RUN, trusted=composed.trusted_targets, where=where)
        cfg = run_config(saved, composed, list(HydraConfig.get().overrides.task))
        cfg.ckpt, cfg.ckpt_pick = str(ckpt), "best"  # every worker loads exactly this one
        check_config(cfg)
        build_task(cfg.task, predicts=cfg.predict)  # a task without them: exit 2 now
        if cfg.get("files"):  # predict.py files=...: paths and the data's reader, now
            read_files(cfg.data, cfg.files)
    except (ConfigError, CheckpointError):
        made_by_this_launch(out_dir, remove=True)  # the empty folders Hydra made: nothing left
        raise
    out_dir.mkdir(parents=True, exist_ok=True)
    return cfg, out_dir


def _prepare(cfg: DictConfig, out_dir: Path, data: bool = True) -> tuple[Any, Any, Any, Any]:
    """(accelerator, loaded checkpoint with the model on its device, data loaders
    (None without ``data``: predicting files needs no training data), the run's task)."""
    accelerator = build_accelerator(cfg, out_dir)
    setup_rank_logging(out_dir)
    loaded = load_checkpoint(cfg.ckpt, cfg.ckpt_pick, cfg.weights, model_config=cfg.model)
    # evaluation_mode: no DDP/FSDP wrapper (nothing to synchronise); every rank
    # holds the whole model and evaluates its shard of the data.
    loaded.model = accelerator.prepare_model(loaded.model, evaluation_mode=True)
    loaders = instantiate(cfg.data, what="data") if data else None
    return accelerator, loaded, loaders, build_task(cfg.task)


def _split(loaders: Any, split: str, accelerator: Any, seed: int) -> Any:
    """The split's loader, its samples drawn as in training (``per_sample``), prepared."""
    loader = getattr(loaders, split, None)
    if loader is None:
        raise ConfigError(
            f"split={split!r} is not allowed: the data ({type(loaders).__name__}) has no "
            f"{split!r} loader; it has: "
            + ", ".join(s for s in SPLITS if getattr(loaders, s, None) is not None)
        )
    if isinstance(loader, DataLoader):
        loader = exact_loader(loader, seed, what=split)
    return accelerator.prepare_data_loader(loader)


def evaluate(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """task.evaluate on the validation split and on a test split when the data
    has one (its metrics renamed ``test/*``); the main process writes eval.json."""
    accelerator, loaded, loaders, task = _prepare(cfg, out_dir)
    metrics = task.evaluate(
        model=loaded.model,
        loader=_split(loaders, "val", accelerator, cfg.seed),
        accelerator=accelerator,
    )
    if getattr(loaders, "test", None) is not None:
        test = task.evaluate(
            model=loaded.model,
            loader=_split(loaders, "test", accelerator, cfg.seed),
            accelerator=accelerator,
        )
        metrics |= {"test/" + k.split("/", 1)[1]: v for k, v in test.items()}
    effective = OmegaConf.to_container(cfg, resolve=True)
    report = {
        "checkpoint": str(loaded.checkpoint),
        "step": loaded.step,
        "weights": loaded.weights,
        "world_size": accelerator.num_processes,
        "metrics": metrics,
        # what differs from the training run in the keys that decide the results
        "config_diff": config_differences(
            run_values(loaded.config), run_values(effective), allowed=()
        ),
    }
    if cfg.predict:
        written = _write_predictions(cfg, out_dir, accelerator, loaded, loaders, task)
        report["predictions"] = str(written)
    if accelerator.is_main_process:
        write_json_atomic(out_dir / "eval.json", report)
    log.info(
        f"{loaded.checkpoint} (step {loaded.step}, weights {loaded.weights}): "
        + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        + f" | {out_dir / 'eval.json'}"
    )
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return report


def predict(cfg: DictConfig, out_dir: Path) -> Path:
    """predictions.csv for ``cfg.split``; returns its path."""
    files = cfg.get("files")
    accelerator, loaded, loaders, task = _prepare(cfg, out_dir, data=not files)
    if files:
        path = _predict_files(cfg, out_dir, accelerator, loaded, task)
    else:
        path = _write_predictions(cfg, out_dir, accelerator, loaded, loaders, task)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return path


@torch.no_grad()
def _write_predictions(
    cfg: DictConfig, out_dir: Path, accelerator: Any, loaded: Any, loaders: Any, task: Any
) -> Path:
    """One row per sample: ``index`` and the columns ``task.predict`` returns (the
    example: ``prediction,target`` for classes; ``loss,perplexity,tokens`` per sequence
    for a language model; sequences as space-separated values). ``gather_for_metrics``
    returns the ranks' batches in dataset order and drops the samples the distributed
    sampler repeated to even out the last batch."""
    split = cfg.split
    loader = getattr(loaders, split, None)
    # e.g. split=train (shuffled, or its own sampler): the same samples in dataset
    # order (what the rows' index means), with the loader's collate_fn
    ordered = in_dataset_order(loader) if isinstance(loader, DataLoader) else loader
    if ordered is not loader and dataclasses.is_dataclass(loaders):
        loaders = dataclasses.replace(loaders, **{split: ordered})
    loader = _split(loaders, split, accelerator, cfg.seed)
    columns = _predicted(accelerator, loaded.model, task, loader)
    path = out_dir / "predictions.csv"
    if accelerator.is_main_process:
        names = list(columns)
        rows = zip(*(torch.cat(columns[n]) for n in names), strict=True) if names else []
        count = _write_csv(
            path, ["index", *names], ([i, *map(_cell, r)] for i, r in enumerate(rows))
        )
        log.info(f"{count} predictions of the {split!r} split ({', '.join(names)}): {path}")
    return path


@torch.no_grad()
def _predict_files(
    cfg: DictConfig, out_dir: Path, accelerator: Any, loaded: Any, task: Any
) -> Path:
    """``files=...`` (a file, a folder of them, a glob, or a list): one row per file,
    in sorted order, read by the data option's ``files`` reader with the run's
    preprocessing (``data.images.image_files``): ``index,path``, the task's columns
    (class indices in ``prediction`` and ``top_k``) and, when the run kept its class
    names (classes.json), ``class`` and ``top_k_classes``."""
    dataset = read_files(cfg.data, cfg.files)
    loader = DataLoader(dataset, batch_size=cfg.data.get("val_batch_size") or 64)
    columns = _predicted(accelerator, loaded.model, task, _files_loader(loader, accelerator, cfg))
    columns.pop("target", None)  # new files have no labels
    names = list(columns)
    classes = read_classes(run_dir_of(loaded.checkpoint))
    named = [n for n in ("prediction", "top_k") if n in names] if classes else []
    path = out_dir / "predictions.csv"
    if accelerator.is_main_process:
        values = [torch.cat(columns[n]) for n in names]
        rows = []
        for i, (file, *row) in enumerate(zip(dataset.paths, *values, strict=True)):
            cells = dict(zip(names, row, strict=True))
            rows.append(
                [i, str(file), *map(_cell, row), *(_class_names(cells[n], classes) for n in named)]
            )
        header = [
            "index",
            "path",
            *names,
            *("class" if n == "prediction" else "top_k_classes" for n in named),
        ]
        count = _write_csv(path, header, rows)
        log.info(f"{count} predictions of {count} files ({', '.join(header[2:])}): {path}")
    return path


def _files_loader(loader: DataLoader, accelerator: Any, cfg: DictConfig) -> Any:
    return accelerator.prepare_data_loader(exact_loader(loader, cfg.seed, what="files"))


def _predicted(
    accelerator: Any, model: Any, task: Any, loader: Any
) -> dict[str, list[torch.Tensor]]:
    """task.predict's columns over the loader, gathered in order across ranks."""
    model.eval()
    columns: dict[str, list[torch.Tensor]] = {}
    for batch in loader:
        predicted = accelerator.gather_for_metrics(task.predict(model=model, batch=batch))
        for name, values in predicted.items():
            columns.setdefault(name, []).append(values.cpu())
    return columns


def _write_csv(path: Path, header: list[str], rows: Any) -> int:
    tmp = path.with_suffix(".csv.tmp")
    count = 0
    with open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for row in rows:
            writer.writerow(row)
            count += 1
    tmp.replace(path)
    return count


def _class_names(value: torch.Tensor, classes: list[str]) -> str:
    indices = [value.item()] if value.dim() == 0 else value.tolist()
    return " ".join(classes[i] if 0 <= i < len(classes) else str(i) for i in indices)


def _cell(value: torch.Tensor) -> str | int | float:
    return value.item() if value.dim() == 0 else " ".join(str(v) for v in value.tolist())
