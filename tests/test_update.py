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
TEMPLATE_FILE = "{{cookiecutter.__project_dir}}/configs/checkpoint/default.yaml"


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
    # ... and a later template commit that changes another file.
    path = template / TEMPLATE_FILE
    text = path.read_text()
    assert "keep_last: 3 " in text
    path.write_text(text.replace("keep_last: 3 ", "keep_last: 5 "))
    git(template, "commit", "-q", "-am", "keep 5 checkpoints")
    updated_to = git(template, "rev-parse", "HEAD").strip()

    check = cruft(project, "check")
    assert check.returncode != 0  # out of date now
    update = cruft(project, "update", "--skip-apply-ask", "--allow-untracked-files")
    transcript = update.stdout + update.stderr
    (REPO / "build").mkdir(exist_ok=True)
    (REPO / "build" / "cruft-update.log").write_text(transcript)
    assert update.returncode == 0, transcript

    assert "keep_last: 5 " in (project / "configs/checkpoint/default.yaml").read_text()
    assert "## Our notes" in readme.read_text()
    assert json.loads((project / ".cruft.json").read_text())["commit"] == updated_to
    changed = sorted(line[3:] for line in git(project, "status", "--porcelain").splitlines())
    assert changed == [".cruft.json", "configs/checkpoint/default.yaml"]  # no conflicts, no .rej
    check = cruft(project, "check")
    assert check.returncode == 0, check.stdout + check.stderr
