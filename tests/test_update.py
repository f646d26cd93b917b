"""A baked project takes in later template changes with cruft, keeping its own.

The bake writes ``.cruft.json`` (hooks/post_gen_project.py); this test bakes
from a git clone of the template at one commit, commits the project, changes
the project and (in a later template commit) the template, and runs the real
``cruft update``: the template's change arrives, the project's survives.
"""

import json
import os
import subprocess
from pathlib import Path

from .conftest import BIN, REPO, bake

GIT_ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "test",
    "GIT_AUTHOR_EMAIL": "test@example.com",
    "GIT_COMMITTER_NAME": "test",
    "GIT_COMMITTER_EMAIL": "test@example.com",
    "GIT_TERMINAL_PROMPT": "0",
}
# An engine file (the engine's own config group) and a recipe file (the project's).
ENGINE_FILE = "training_engine/src/training_engine/schema/checkpoint.py"  # keep_last's default
RECIPE_FILE = "{{cookiecutter.__project_dir}}/configs/optimizer/adamw.yaml"


def git(cwd: Path, *args: str) -> str:
    proc = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, env=GIT_ENV, check=False
    )
    assert proc.returncode == 0, f"git {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def cruft(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "cruft"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=GIT_ENV,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


def test_cruft_update_brings_template_changes_and_keeps_the_projects(tmp_path, cookiecutter_config):
    template = tmp_path / "template"
    git(tmp_path, "clone", "-q", str(REPO), str(template))
    baked_at = git(template, "rev-parse", "HEAD").strip()

    proc = bake(f"git+file://{template}", cookiecutter_config, tmp_path / "out")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (project,) = (tmp_path / "out").iterdir()
    state = json.loads((project / ".cruft.json").read_text())
    assert state["template"] == f"file://{template}" and state["commit"] == baked_at
    assert state["context"]["cookiecutter"]["project_slug"] == project.name
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "baked")
    check = cruft(project, "check")
    assert check.returncode == 0, check.stdout + check.stderr

    # The project's own change, committed ...
    readme = project / "README.md"
    readme.write_text(readme.read_text() + "\n## Our notes\n\nKept across template updates.\n")
    git(project, "commit", "-q", "-am", "our notes")
    # ... and a later template commit that changes the engine only: the update changes
    # the engine's pin (its commit), nothing else.
    pinned_at = f"@{baked_at}#subdirectory=training_engine"
    assert pinned_at in (project / "pyproject.toml").read_text()
    edit(
        template / ENGINE_FILE,
        '        3,\n        "the newest N',
        '        5,\n        "the newest N',
    )
    git(template, "commit", "-q", "-am", "keep 5 checkpoints")
    updated_to = update(project)
    assert changes(project) == [".cruft.json", "pyproject.toml"]  # no conflicts, no .rej
    diff = [
        line
        for line in git(project, "diff", "HEAD", "-U0", "pyproject.toml").splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert diff == [
        f'-    "training-engine @ git+file://localhost{template}{pinned_at}",',
        f'+    "training-engine @ git+file://localhost{template}@{updated_to}#subdirectory=training_engine",',
    ]
    git(project, "commit", "-q", "-am", "engine update")

    # A recipe change arrives as a change of that file (and of the pin).
    edit(template / RECIPE_FILE, "lr: 3.0e-3", "lr: 2.0e-3")
    git(template, "commit", "-q", "-am", "a lower learning rate")
    update(project)
    assert "lr: 2.0e-3" in (project / "configs/optimizer/adamw.yaml").read_text()
    assert "## Our notes" in readme.read_text()
    assert changes(project) == [".cruft.json", "configs/optimizer/adamw.yaml", "pyproject.toml"]


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new))


def changes(project: Path) -> list[str]:
    return sorted(line[3:] for line in git(project, "status", "--porcelain").splitlines())


def update(project: Path) -> str:
    """``cruft update``; the commit it updated to, checked: up to date afterwards."""
    check = cruft(project, "check")
    assert check.returncode != 0  # out of date now
    proc = cruft(project, "update", "--skip-apply-ask", "--allow-untracked-files")
    transcript = proc.stdout + proc.stderr
    (REPO / "build").mkdir(exist_ok=True)
    (REPO / "build" / "cruft-update.log").write_text(transcript)
    assert proc.returncode == 0, transcript
    updated_to = json.loads((project / ".cruft.json").read_text())["commit"]
    assert cruft(project, "check").returncode == 0
    return updated_to
