"""Shared helpers: run the real train.py in a subprocess, compose real configs."""

import json
import os
import re
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from {{ cookiecutter.package_name }}.engine.config import register_resolvers
from {{ cookiecutter.package_name }}.engine.tracking import REQUIRES

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = PROJECT_ROOT / "configs"
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
TRAIN_WITH_FAULTS = str(PROJECT_ROOT / "tests" / "train_with_faults.py")
# For train.py subprocesses: the tests' own modules (tests.faults) must be
# importable in every worker they start.
PATHS = [str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in PATHS if p)}


def fingerprints(run_dir: Path) -> dict[str, str]:
    """The final weights fingerprint each rank logged, by log file."""
    found = {}
    for log in sorted(run_dir.glob("train*.log")):
        match = re.search(r"final weights fingerprint (\w+)", log.read_text())
        if match:
            found[log.name] = match.group(1)
    return found


def wait_for(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def require_trackers(*names: str) -> None:
    """Tests of optional trackers need their packages (``pip install -e '.[dev]'``
    installs them all). Only where TESTS_SKIP_MISSING_EXTRAS=1 says that the
    environment lacks them on purpose is a missing one a skip; anywhere else
    the test runs and fails, naming the install command."""
    missing = [m for name in names for m in REQUIRES.get(name, ()) if find_spec(m) is None]
    if missing and os.environ.get("TESTS_SKIP_MISSING_EXTRAS") == "1":
        pytest.skip(f"not installed here: {', '.join(missing)}")


class TrainRun:
    def __init__(self, proc: subprocess.CompletedProcess, run_dir: Path) -> None:
        self.proc = proc
        self.run_dir = run_dir
        self.output = proc.stdout + proc.stderr

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())


def run_train(
    run_dir: Path,
    *overrides: str,
    check: bool = True,
    timeout: int = 300,
    pause_at: str | None = None,
    as_baked: bool = False,
) -> TrainRun:
    """``python train.py hydra.run.dir=RUN_DIR OVERRIDES`` from the project root;
    with ``pause_at``, through tests/train_with_faults.py (CKPT_TEST_PAUSE_AT).
    One process unless OVERRIDES name a parallel mode; ``as_baked``: the bake's default."""
    pinned = [] if as_baked else [ONE_PROCESS]
    script = TRAIN_WITH_FAULTS if pause_at else "train.py"
    cmd = [sys.executable, script, f"hydra.run.dir={run_dir}", *pinned, *overrides]
    env = {**os.environ, "CKPT_TEST_PAUSE_AT": pause_at} if pause_at else None
    proc = subprocess.run(
        cmd,
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    run = TrainRun(proc, run_dir)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{run.output[-4000:]}")
    if check and ("terminate called" in run.output or "Aborted" in run.output):
        pytest.fail(f"a process aborted on its way out:\n{run.output[-4000:]}")
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

    def _compose(*overrides: str, hydra_config: bool = False):
        register_resolvers(PROJECT_ROOT)  # as train.py does before @hydra.main
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return compose("train", overrides=list(overrides), return_hydra_config=hydra_config)

    return _compose
