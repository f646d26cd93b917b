"""Write a trained run's predictions: ``predictions.csv`` with one row per sample
of a split (``index,prediction,target``), in dataset order, gathered across ranks
without duplicates. ``python predict.py --help``.

    python predict.py ckpt=runs/exp1                   # its best checkpoint, validation split
    python predict.py ckpt=runs/exp1 split=train weights=ema parallel=ddp

What a prediction is, the task decides (task.predict). README: "Evaluate, predict, load a model".
"""

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from {{ cookiecutter.package_name }} import evaluation
from {{ cookiecutter.package_name }}.checkpoint import CheckpointError
from {{ cookiecutter.package_name }}.config import ConfigError, register_resolvers
from {{ cookiecutter.package_name }}.launch import LaunchError, run

log = logging.getLogger("predict")
PROJECT_ROOT = Path(__file__).resolve().parent


@hydra.main(version_base="1.3", config_path="configs", config_name="predict")
def main(raw: DictConfig) -> None:
    register_resolvers(PROJECT_ROOT)
    try:
        cfg, out_dir = evaluation.prepare(raw)
        run(evaluation.predict, cfg, out_dir)  # here, or in N spawned workers
    except (ConfigError, LaunchError, CheckpointError) as err:
        log.error(str(err))  # exit codes: 2 bad config, 1 failure
        sys.exit(err.exit_code)


if __name__ == "__main__":
    register_resolvers(PROJECT_ROOT)
    main()
