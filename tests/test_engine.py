"""The engine as a library (training_engine/, its own distribution): a checkpoint
written by its previous release resumes with this one bit for bit, or is refused
before any work (exit 2) naming both releases; an ejected project owns a copy of
the engine and passes its own tests."""

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from training_engine.checkpoint.checksums import path_entry

from .conftest import BIN, REPO

ENGINE = REPO / "training_engine"
# The first override of each run: one process, few steps, checkpoints every 10 of 40.
RUN = [
    "parallel=none",
    "tracker=csv",
    "preflight=off",
    "trainer.max_steps=40",
    "trainer.log_every_n_steps=5",
    "trainer.eval_every_n_steps=10",
    "checkpoint.every_n_steps=10",
]
# What a checkpoint holds of the training state (MANIFEST, trainer_state and config are
# the format's, compared by reading them).
TENSOR_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_rank0.pt")


def releases() -> list[tuple[str, str]]:
    """(version, commit) of each release, oldest first: RELEASES.md's table."""
    text = (ENGINE / "RELEASES.md").read_text()
    return re.findall(r"^\|\s*(\d+\.\d+\.\d+)\s*\|\s*([0-9a-f]{40})\s*\|", text, re.MULTILINE)


def engine_version(root: Path) -> str:
    text = (root / "src" / "training_engine" / "version.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def bake_local(template: Path, out: Path) -> Path:
    proc = subprocess.run(
        [str(BIN / "cookiecutter"), "--no-input", "-o", str(out), str(template)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HOME": str(out)},  # cookiecutter's replay dir: not ~
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (project,) = (p for p in out.iterdir() if p.is_dir() and not p.name.startswith("."))
    return project


def train(project: Path, run_dir: Path, *overrides: str, engine: Path | None = None):
    """train.py of ``project``, with the engine of ``engine`` (a training_engine/
    folder) first on the path, else the one installed here."""
    paths = [str(engine / "src")] if engine else []
    paths += [str(project), str(project / "src"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    return subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *overrides],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def fingerprint(run_dir: Path) -> str:
    return re.search(r"final weights fingerprint (\w+)", (run_dir / "train.log").read_text())[1]


def test_the_release_table_names_commits_of_this_history():
    found = releases()
    assert found, "training_engine/RELEASES.md records no release"
    assert [v for v, _ in found] == sorted(
        {v for v, _ in found}, key=lambda v: tuple(map(int, v.split(".")))
    )
    for _, commit in found:
        known = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"])
        assert known.returncode == 0, f"release commit {commit} is not in this clone's history"
    # The version is in one place, and the changelog has an entry for it.
    assert f"## {engine_version(ENGINE)}" in (ENGINE / "CHANGELOG.md").read_text()


def test_a_checkpoint_of_the_previous_release_resumes_with_this_engine_bit_for_bit(tmp_path):
    version, commit = releases()[-1]  # the latest release: what a project upgrades from
    old_template = tmp_path / "old-template"
    old_template.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(old_template)], input=archive, check=True)
    assert engine_version(old_template / "training_engine") == version
    old = bake_local(old_template, tmp_path / "old-bake")
    new = bake_local(REPO, tmp_path / "new-bake")

    # The previous release trains 20 of 40 steps and is killed with kill -9 there.
    killed = tmp_path / "old-run"
    kill = [
        "+callbacks.kill._target_=tests.test_recipe.KillOnce",
        "+callbacks.kill.step=20",
        f"+callbacks.kill.marker={tmp_path / 'killed'}",
    ]
    proc = train(old, killed, *RUN, *kill, engine=old_template / "training_engine")
    assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-2000:]
    (ckpt,) = [p for p in (killed / "checkpoints").glob("step_*") if p.name.endswith("20")]
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    assert manifest["versions"]["training_engine"] == version

    # This engine, in the new project's recipe, continues it; and trains it whole.
    resumed = train(new, tmp_path / "resumed", *RUN, f"checkpoint.resume={killed}")
    whole = train(new, tmp_path / "whole", *RUN)
    assert whole.returncode == 0, whole.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    if resumed.returncode == 2:  # a format this engine no longer reads: refused, named
        assert version in said and engine_version(ENGINE) in said and "CHANGELOG" in said
        assert "Traceback" not in said
        return
    assert resumed.returncode == 0, said[-3000:]
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["step"] == 40 and str(ckpt) in str(summary["resumed_from"])

    # What "bit for bit" can mean across releases: the continuation this engine makes
    # from the old checkpoint's state is the one it makes from its own checkpoint
    # holding the same tensors. Where the two releases trained the first 20 steps to
    # the same bits (the usual case), that is the uninterrupted run itself; where they
    # did not (another CPU's kernels can round a changed code path differently), this
    # engine's own step-20 checkpoint with the old tensors put in is the reference:
    # the old manifest, trainer state and config must be read as this engine's are.
    own = tmp_path / "whole" / "checkpoints" / ckpt.name
    differ = [n for n in TENSOR_FILES if (own / n).read_bytes() != (ckpt / n).read_bytes()]
    if not differ:
        assert fingerprint(tmp_path / "resumed") == fingerprint(tmp_path / "whole")
        return
    warnings.warn(
        f"releases {version} and {engine_version(ENGINE)} trained steps 1-20 to other bits "
        f"on this machine ({', '.join(differ)} differ); losses, old: "
        f"{losses(killed)}; this engine: {losses(tmp_path / 'whole')}",
        stacklevel=1,
    )
    transplant = tmp_path / "transplant" / ckpt.name
    shutil.copytree(own, transplant)
    manifest = json.loads((transplant / "MANIFEST.json").read_text())
    for name in differ:
        shutil.copyfile(ckpt / name, transplant / name)
        manifest["files"][name] = path_entry(transplant / name)
    (transplant / "MANIFEST.json").write_text(json.dumps(manifest))
    reference = train(new, tmp_path / "reference", *RUN, f"checkpoint.resume={transplant}")
    assert reference.returncode == 0, (reference.stdout + reference.stderr)[-3000:]
    assert fingerprint(tmp_path / "resumed") == fingerprint(tmp_path / "reference")


def losses(run_dir: Path) -> dict[int, str]:
    """train/loss at each logged step, as metrics.csv (tracker=csv) wrote it."""
    rows = (run_dir / "metrics.csv").read_text().splitlines()[1:]
    return {int(r.split(",")[1]): r.split(",")[3] for r in rows if ",train/loss," in r}


def test_an_ejected_project_owns_its_engine_and_passes_its_own_tests(tmp_path):
    project = bake_local(REPO, tmp_path / "bake")
    env = {**os.environ, "PYTHONPATH": str(project / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "training_engine", "eject"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    copy = project / "src" / "training_engine"
    assert json.loads((copy / "EJECTED.json").read_text())["version"] == engine_version(ENGINE)
    deps = (project / "pyproject.toml").read_text()
    assert "training-engine @" not in deps and "ejected from training-engine" in deps
    assert (project / "src" / "hydra_plugins" / "training_engine_optuna" / "sweeper.py").is_file()
    # The project's copy is the engine that runs now, not the one installed here.
    where = subprocess.run(
        [sys.executable, "-c", "import training_engine; print(training_engine.__file__)"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(copy)
    again = subprocess.run(
        [sys.executable, "-m", "training_engine", "eject"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2 and "already holds an engine" in again.stderr
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "auto", "tests"],
        cwd=project,
        env={**env, "TESTS_SKIP_MISSING_EXTRAS": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert tests.returncode == 0 and " passed" in tests.stdout, tests.stdout[-4000:]


def test_the_engine_lints():
    """ruff, with the engine's own settings (training_engine/pyproject.toml)."""
    for args in (["check", "."], ["format", "--check", "."]):
        proc = subprocess.run(
            [str(BIN / "ruff"), *args], cwd=ENGINE, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
