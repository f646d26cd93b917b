"""Evaluate a trained run's checkpoint: metrics on the validation split (and on a
test split when the data has one) in ``eval.json``. ``python eval.py --help``.

    python eval.py ckpt=runs/exp1                      # its best checkpoint
    python eval.py ckpt=runs/exp1 ckpt_pick=latest weights=ema
    python eval.py ckpt=runs/exp1/checkpoints/step_0000500 parallel=ddp data.val_batch_size=64

The model, data, seed and precision come from the run's own config; the command
line's overrides apply on top. docs/lifecycle.md.
"""

from pathlib import Path

import hydra
from omegaconf import DictConfig
from training_engine import evaluation
from training_engine.config import register_resolvers
from training_engine.entry import run_entry_point

PROJECT_ROOT = Path(__file__).resolve().parent
CONFIG_DIR = PROJECT_ROOT / "configs"


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(raw: DictConfig) -> None:
    register_resolvers(PROJECT_ROOT)
    evaluation.main(raw, evaluation.evaluate)


if __name__ == "__main__":
    register_resolvers(PROJECT_ROOT)
    run_entry_point(main, CONFIG_DIR, "eval")  # Hydra's command-line errors: exit 2 too
