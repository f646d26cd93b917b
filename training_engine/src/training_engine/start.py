"""How a training launch starts and ends (a project's ``train.py`` hands it its
``train``): the config resolved and checked, the run dir claimed, training here or in
the workers of this node, and each failure its one message and exit code (entry.py:
2 bad input, 1 failure, 3 NaN/inf loss, 4 an Optuna trial pruned, 143/138/140 a stop
signal). Bad input leaves nothing on disk."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from omegaconf import DictConfig

from .checkpoint import CheckpointError
from .claim import claim
from .config import ConfigError, check_config, resolve_config
from .ema import metric_names
from .launch import LaunchError, adopt_pet_env, close_process_group, run, runs_alone, spans_nodes
from .nonfinite import NonFiniteLoss
from .preemption import TrainingInterrupted
from .preflight import PreflightFailed
from .pruning import TrialPruned
from .run_dir import (
    check_run_name,
    hydra_run_dir,
    hydra_run_dir_as_written,
    in_sweep,
    made_by_this_launch,
    uses_default_run_name,
)
from .summary import report_finished
from .task import build_task
from .tracking import check_reachable
from .trainer import TRAIN_METRICS

log = logging.getLogger("train")
FAILURES = (ConfigError, LaunchError, CheckpointError, NonFiniteLoss, PreflightFailed)


def launch(raw: DictConfig, train: Callable[..., float | None]) -> float | None:
    """Check the config, claim the run dir, ``train(cfg, run_dir, decision=...)`` here
    or in spawned workers; the best value of trainer.monitor."""
    cfg = resolve_config(raw)  # plain and resolved: no ${...}, no Hydra state needed
    adopt_pet_env(cfg.parallel)  # in a Kubeflow Trainer pod: nodes, rank, rendezvous
    check_config(cfg)
    check_run_name(cfg)  # inside runs_root
    task = build_task(cfg.task)  # a task that lacks a method the engine calls: exit 2
    monitored = (*TRAIN_METRICS, *task.metrics, *metric_names(cfg.trainer.ema, task.metrics))
    if cfg.trainer.monitor not in monitored and not cfg.trainer.monitor.startswith(
        ("perf/", "train/")
    ):
        raise ConfigError(
            f"trainer.monitor={cfg.trainer.monitor!r} is not a logged metric; available: "
            + ", ".join(monitored)
        )
    if uses_default_run_name(raw) and spans_nodes(cfg.parallel):
        raise ConfigError(
            "a run on several nodes needs one run directory, but the default run_name is "
            "each node's own launch time: give every node's command the same run_name=NAME "
            "(or hydra.run.dir=DIR on storage every node shares)"
        )
    check_reachable(cfg)  # a tracking server that does not answer: exit 2 in seconds
    run_dir = hydra_run_dir()
    # The main process decides (new, continue, finished, or refused: exit 2); an attempt
    # that fails before its first step is taken back (claim.py).
    with claim(run_dir, cfg, raw) as claimed:
        decision = claimed.decision
        if decision is not None and decision.finished and runs_alone(cfg.parallel):
            return report_finished(run_dir, decision.summary)
        return run(partial(train, decision=decision), cfg, run_dir)  # here, or N workers


def launch_training(raw: DictConfig, train: Callable[..., Any]) -> float | None:
    """``launch``, with each failure its message and exit code (in a sweep: raised, so
    Hydra marks the job failed and runs the others; the sweeper records a pruned trial)."""
    try:
        return launch(raw, train)
    except FAILURES as err:
        log.error(str(err))
        if in_sweep():
            raise
        if err.exit_code == 2:  # bad input: nothing left on disk
            made_by_this_launch(hydra_run_dir_as_written(), remove=True)
        close_process_group()  # under torchrun this process is a rank
        sys.exit(err.exit_code)
    except TrialPruned as err:  # an Optuna trial stopped by its pruner (exit code 4)
        log.info(str(err))
        if in_sweep():
            raise
        sys.exit(err.exit_code)
    except TrainingInterrupted as err:  # SIGTERM 143, SIGUSR1 138, SIGUSR2 140: rerun resumes
        log.warning(str(err))
        sys.exit(err.exit_code)
