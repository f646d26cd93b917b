"""Write a trained run's predictions: ``predictions.csv`` with one row per sample
of a split (``index,prediction,target``), in dataset order, gathered across ranks
without duplicates. ``python predict.py --help``.

    python predict.py ckpt=runs/exp1                   # its best checkpoint, validation split
    python predict.py ckpt=runs/exp1 split=train weights=ema parallel=ddp

What a prediction is, the task decides (task.predict). docs/lifecycle.md.
"""

from pathlib import Path

import hydra
from omegaconf import DictConfig
from training_engine import evaluation
from training_engine.config import register_resolvers
from training_engine.entry import run_entry_point

PROJECT_ROOT = Path(__file__).resolve().parent
CONFIG_DIR = PROJECT_ROOT / "configs"


@hydra.main(version_base="1.3", config_path="configs", config_name="predict")
def main(raw: DictConfig) -> None:
    register_resolvers(PROJECT_ROOT)
    evaluation.main(raw, evaluation.predict)


if __name__ == "__main__":
    register_resolvers(PROJECT_ROOT)
    run_entry_point(main, CONFIG_DIR, "predict")  # Hydra's command-line errors: exit 2 too
