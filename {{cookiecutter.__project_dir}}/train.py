"""Train the configured model. Read top to bottom: this file is the recipe.

    python train.py                                  # defaults from configs/train.yaml
    python train.py model=cnn optimizer.lr=3e-3      # override anything
    python train.py -m optimizer.lr=1e-3,1e-2 seed=1,2   # a sweep
    python train.py run_name=exp1                    # rerun after a crash: resumes in runs/exp1
                                                     # (a finished run: reports it, changes nothing)

The task (what a batch is, the loss, the training step, the evaluation) is an object
built from configs/task/ (src/{{ cookiecutter.package_name }}/tasks/); callbacks from
configs/callbacks/. The run around the step (run directory, accelerator, checkpoints
and resume, signals, trackers, seeding, evaluation, progress, preflight) is the
engine's ``Trainer`` (training_engine/trainer.py), which decides about ranks itself.
"""

from pathlib import Path

import hydra
from omegaconf import DictConfig
from training_engine.config import register_resolvers
from training_engine.entry import run_entry_point
from training_engine.start import launch_training
from training_engine.trainer import Trainer

PROJECT_ROOT = Path(__file__).resolve().parent  # runs_root's default: <project root>/runs


def train(cfg: DictConfig, run_dir: Path, decision=None) -> float | None:
    """One process's training; runs on every rank. Returns the best value of
    trainer.monitor. ``decision``: the launch's claim of the run dir (main process)."""
    # Everything up to the first step: accelerator, seeds, task, data, model,
    # optimizers, schedule, the resume plan and the restored state, preflight.
    trainer = Trainer(cfg, run_dir, decision)
    if trainer.done:  # a finished run, or preflight.only=true
        return trainer.result
    task, step = trainer.task, trainer.step  # step: the verbs of the training step
    for batch in trainer.batches():  # in order, from where the run stands; ends with it
        # the task's step: forward, loss, backward; at the accumulation's end clipping
        # and the update (the default: training_engine/task.py, TaskDefaults.training_step)
        loss, logs = task.training_step(step=step, batch=batch)
        trainer.log_step(loss, logs)  # train/loss and the task's logs, over the log window
        if step.update_done():
            # logs, the ranks' agreement (NaN/inf, stop signals), evaluation, checkpoints,
            # the callbacks of configs/callbacks/, Optuna pruning
            trainer.after_update()
    # the last checkpoint, the final weights (model.safetensors), summary.json last
    return trainer.finish()


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    register_resolvers(PROJECT_ROOT)  # again: SLURM job processes never ran __main__
    # check the config, claim the run dir, train here or in one worker per process;
    # each failure its message and exit code (2: bad input, nothing left on disk)
    return launch_training(cfg, train)


if __name__ == "__main__":
    register_resolvers(PROJECT_ROOT)
    run_entry_point(main, PROJECT_ROOT / "configs", "train")  # Hydra's errors: exit 2 too
