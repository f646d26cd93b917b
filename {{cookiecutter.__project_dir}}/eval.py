"""Evaluate a trained run's checkpoint: metrics on the validation split (and on a
test split when the data has one) in ``eval.json``. ``python eval.py --help``.

    python eval.py ckpt=runs/exp1                      # its best checkpoint
    python eval.py ckpt=runs/exp1 ckpt_pick=latest weights=ema
    python eval.py ckpt=runs/exp1/checkpoints/step_0000500 parallel=ddp data.val_batch_size=64

The model, data, seed and precision come from the run's own config; the command
line's overrides apply on top. README: "Evaluate, predict, load a model".
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

log = logging.getLogger("eval")
PROJECT_ROOT = Path(__file__).resolve().parent


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(raw: DictConfig) -> None:
    register_resolvers(PROJECT_ROOT)
    try:
        cfg, out_dir = evaluation.prepare(raw)
        run(evaluation.evaluate, cfg, out_dir)  # here, or in N spawned workers
    except (ConfigError, LaunchError, CheckpointError) as err:
        log.error(str(err))  # exit codes: 2 bad config, 1 failure
        sys.exit(err.exit_code)


if __name__ == "__main__":
    register_resolvers(PROJECT_ROOT)
    main()
