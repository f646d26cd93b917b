"""The project's own tests: its configs compose, its recipe trains, and a run killed
with kill -9 resumes bit for bit (tests/test_recipe.py). The engine's own tests run
where the engine is released, not here (docs/updates.md)."""

import os
from functools import partial
from pathlib import Path

import pytest
from training_engine.testing import (
    TrainRun,
    compose_train,
    failure,
    pythonpath,
    require_trackers,  # noqa: F401 (the tests import it from here)
    run_script,
)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# A few steps, logged and evaluated often enough to check every output; the csv
# tracker (the default is a bake-time choice) and no preflight (its timed steps).
FAST = [
    "trainer.max_steps=30",
    "trainer.log_every_n_steps=5",
    "trainer.eval_every_n_steps=10",
    "tracker=csv",
    "preflight=off",
]
# train.py's processes import this folder's modules (tests.test_recipe's callback).
ENV = {**os.environ, "PYTHONPATH": pythonpath(PROJECT_ROOT)}


def run_train(run_dir: Path, *overrides: str, check: bool = True) -> TrainRun:
    """``python train.py hydra.run.dir=RUN_DIR OVERRIDES`` in the project's folder."""
    run = run_script(PROJECT_ROOT, run_dir, *overrides, env=ENV, timeout=600)
    problem = failure(run) if check else None
    if problem:
        pytest.fail(problem)
    return run


@pytest.fixture
def compose_cfg():
    """Compose ``configs/train.yaml`` with overrides, as ``python train.py`` would."""
    return partial(compose_train, PROJECT_ROOT)
