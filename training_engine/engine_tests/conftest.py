"""The engine's tests, on a baked project: they run the real train.py of the project
in the current directory (or TRAINING_ENGINE_PROJECT), a bake of the template's
defaults (package ``digit_trainer``), in a subprocess, and compose its real configs.
``make test`` in the template's repository runs them once, on its default bake."""

import os
import time
from functools import partial
from pathlib import Path

import pytest

from training_engine.testing import (
    TrainRun,
    compose_train,
    config_options,
    failure,
    fingerprints,  # noqa: F401 (the tests import it from here)
    pythonpath,
    require_trackers,  # noqa: F401 (the tests import it from here)
    run_script,
)

PROJECT_ROOT = Path(os.environ.get("TRAINING_ENGINE_PROJECT") or Path.cwd()).resolve()
# This folder: the tests' own modules are engine_tests.* (faults, hf_gpt2, user_code).
TESTS = Path(__file__).resolve().parent
CONFIG_DIR = PROJECT_ROOT / "configs"
# Every option's file, the project's and the engine's groups: (group, option) -> path
CONFIG_FILES = config_options(PROJECT_ROOT)
# The first override of every train.py the tests start: one process unless a test
# names its parallel mode (a later parallel=... wins). The baked default may be ddp
# or fsdp (the scope prompt); test_smoke_run_writes_the_run_directory runs it as is.
ONE_PROCESS = "parallel=none"

# A few steps, logged and evaluated often enough to check every output
# (tracker=csv explicitly: the project's default tracker is a bake-time choice;
# preflight off: it would add its timed steps to every run; test_preflight.py
# turns it on).
FAST = [
    "trainer.max_steps=30",
    "trainer.log_every_n_steps=5",
    "trainer.eval_every_n_steps=10",
    "tracker=csv",
    "preflight=off",
]
# train.py with the checkpoint pause points of CKPT_TEST_PAUSE_AT (fault injection).
TRAIN_WITH_FAULTS = str(TESTS / "train_with_faults.py")
# For train.py subprocesses: the tests' own modules (engine_tests.faults) must be
# importable in every worker they start (TESTS.parent), and so must the project's.
PATHS = {
    "PYTHONPATH": pythonpath(TESTS.parent, PROJECT_ROOT),
    "TRAINING_ENGINE_PROJECT": str(PROJECT_ROOT),
}
ENV = {**os.environ, **PATHS}


def wait_for(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def run_train(
    run_dir: Path,
    *overrides: str,
    check: bool = True,
    timeout: int = 300,
    pause_at: str | None = None,
    as_baked: bool = False,
) -> TrainRun:
    """``python train.py hydra.run.dir=RUN_DIR OVERRIDES`` from the project root;
    with ``pause_at``, through engine_tests/train_with_faults.py (CKPT_TEST_PAUSE_AT).
    One process unless OVERRIDES name a parallel mode; ``as_baked``: the bake's default."""
    pinned = [] if as_baked else [ONE_PROCESS]
    script = TRAIN_WITH_FAULTS if pause_at else "train.py"
    # the environment as it is now (a test may have set variables), and the paths
    env = {**os.environ, **PATHS, **({"CKPT_TEST_PAUSE_AT": pause_at} if pause_at else {})}
    run = run_script(
        PROJECT_ROOT, run_dir, *pinned, *overrides, script=script, env=env, timeout=timeout
    )
    problem = failure(run) if check else None
    if problem:
        pytest.fail(problem)
    return run


@pytest.fixture
def train_run(tmp_path):
    """Call as ``train_run(*overrides)``; every call gets its own run dir."""
    counter = iter(range(1000))

    def _run(*overrides: str, check: bool = True, as_baked: bool = False) -> TrainRun:
        return run_train(
            tmp_path / f"run{next(counter)}", *overrides, check=check, as_baked=as_baked
        )

    return _run


@pytest.fixture
def compose_cfg():
    """Compose ``configs/train.yaml`` with overrides, as ``python train.py`` would."""
    return partial(compose_train, PROJECT_ROOT)
