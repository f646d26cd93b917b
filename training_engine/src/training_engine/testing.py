"""What a project's own tests use of the engine: run the project's real ``train.py``
in a subprocess, read what it wrote, compose its real configs. The engine's tests use
the same helpers on a bake of the template's defaults."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path

from .tracking import REQUIRES


class TrainRun:
    """One finished ``train.py`` process: its output and its run dir."""

    def __init__(self, proc: subprocess.CompletedProcess, run_dir: Path) -> None:
        self.proc = proc
        self.run_dir = run_dir
        self.output = proc.stdout + proc.stderr

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())


def run_script(
    project: Path,
    run_dir: Path,
    *overrides: str,
    script: str | Sequence[str] = "train.py",
    env: dict | None = None,
    timeout: int = 300,
) -> TrainRun:
    """``python SCRIPT hydra.run.dir=RUN_DIR OVERRIDES`` in the project's folder."""
    prefix = [script] if isinstance(script, str) else list(script)
    cmd = [sys.executable, *prefix, f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(
        cmd,
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return TrainRun(proc, run_dir)


def failure(run: TrainRun) -> str | None:
    """Why a run that had to succeed did not, or None."""
    if run.proc.returncode != 0:
        return f"{' '.join(run.proc.args)} exited {run.proc.returncode}:\n{run.output[-4000:]}"
    if "terminate called" in run.output or "Aborted" in run.output:
        return f"a process aborted on its way out:\n{run.output[-4000:]}"
    return None


def fingerprints(run_dir: Path) -> dict[str, str]:
    """The final weights fingerprint each rank logged, by log file."""
    found = {}
    for log in sorted(run_dir.glob("train*.log")):
        match = re.search(r"final weights fingerprint (\w+)", log.read_text())
        if match:
            found[log.name] = match.group(1)
    return found


def checkpoint_differences(run_dir: Path, other: Path) -> str:
    """What differs between two runs' checkpoints of the same steps (the ones both
    still keep), by step and file: the model's and optimizer's tensors, the RNG
    states, the scheduler, the position and the config (times and rates aside). A
    resumed run that differs from an uninterrupted one differs from the checkpoint it
    resumed from on (a resume defect), or already in it (the runs parted before the
    interruption)."""
    import torch
    from safetensors.torch import load_file

    def load(path: Path):
        if path.suffix == ".safetensors":
            return load_file(path)
        if path.suffix == ".pt":
            return torch.load(path, map_location="cpu", weights_only=True)
        return untimed(json.loads(path.read_text()))

    def untimed(tree):  # what differs between any two runs: times, rates, the run's name
        if isinstance(tree, dict):
            return {
                k: untimed(v)
                for k, v in tree.items()
                if not (k.startswith("perf/") or k.endswith("_s") or k == "run_name")
            }
        return [untimed(v) for v in tree] if isinstance(tree, list) else tree

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
            )
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list | tuple) and isinstance(b, list | tuple):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    lines = []
    steps = {p.name for p in (run_dir / "checkpoints").glob("step_*")}
    for name in sorted(steps & {p.name for p in (other / "checkpoints").glob("step_*")}):
        ours, theirs = run_dir / "checkpoints" / name, other / "checkpoints" / name
        files = sorted(  # MANIFEST.json: the files' checksums and the time of writing
            f.name
            for f in ours.iterdir()
            if f.suffix in (".safetensors", ".pt", ".json") and f.name != "MANIFEST.json"
        )
        differ = [f for f in files if not same(load(ours / f), load(theirs / f))]
        lines.append(f"{name}: {'differs in ' + ', '.join(differ) if differ else 'the same'}")
    return "; ".join(lines) or "no checkpoint of the same step in both"


def missing_tracker_packages(*names: str) -> list[str]:
    """The packages of these trackers that are not installed here."""
    return [m for name in names for m in REQUIRES.get(name, ()) if find_spec(m) is None]


def require_trackers(*names: str) -> None:
    """Tests of optional trackers need their packages (``pip install -e '.[dev]'``
    installs them all). Only where TESTS_SKIP_MISSING_EXTRAS=1 says that the
    environment lacks them on purpose is a missing one a skip; anywhere else the
    test runs and fails, naming the install command."""
    import pytest

    missing = missing_tracker_packages(*names)
    if missing and os.environ.get("TESTS_SKIP_MISSING_EXTRAS") == "1":
        pytest.skip(f"not installed here: {', '.join(missing)}")


def compose_train(project: Path, *overrides: str, hydra_config: bool = False):
    """``configs/train.yaml`` of the project composed with overrides, as
    ``python train.py`` composes it: an override Hydra refuses (a key that is not
    there, a value of the wrong type for the engine's schema) is the ConfigError
    with the message train.py exits 2 with (entry.py)."""
    from hydra import compose
    from hydra.errors import ConfigCompositionException, OverrideParseException

    from .config import ConfigError
    from .entry import command_line_problems

    try:
        with composed_configs(project):
            return compose("train", overrides=list(overrides), return_hydra_config=hydra_config)
    except (ConfigCompositionException, OverrideParseException) as err:
        # outside the with: the message composes the config again to suggest a key
        said = command_line_problems(err, project / "configs", "train", list(overrides))
    raise ConfigError(said)


@contextmanager
def composed_configs(project: Path) -> Iterator[None]:
    """Hydra initialised on the project's ``configs/``, its resolvers registered, as
    ``python train.py`` has them before ``@hydra.main``: ``hydra.compose(...)`` inside."""
    from hydra import initialize_config_dir

    from .config import register_resolvers

    register_resolvers(project)
    with initialize_config_dir(config_dir=str(project / "configs"), version_base="1.3"):
        yield


def pythonpath(*paths: Path | str) -> str:
    """PYTHONPATH with these first, then what it held."""
    given = [str(p) for p in paths] + [os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in given if p)


def config_options(project: Path) -> dict[tuple[str, str], Path]:
    """Every option of every config group a project composes, ``(group, option) ->
    file``: its own configs/ and the engine's groups (the project's file wins, as on
    Hydra's search path)."""
    from .entry import ENGINE_CONFIGS

    found: dict[tuple[str, str], Path] = {}
    for root in (ENGINE_CONFIGS, project / "configs"):  # the project's last: it wins
        for path in sorted(root.rglob("*.yaml")):
            if path.parent != root:
                found[(path.parent.relative_to(root).as_posix(), path.stem)] = path
    return found
