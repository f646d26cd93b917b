"""Bake the template the way users do: the real cookiecutter CLI on a git URL.

Baking from ``git+file://<repo>`` clones the committed tree, exactly like
``cookiecutter gh:org/template``: a file that is not in git is missing here
too. Uncommitted changes are therefore NOT tested; a warning says so.
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
COOKIECUTTER_JSON = json.loads((REPO / "cookiecutter.json").read_text())


@pytest.fixture(scope="session")
def template_url() -> str:
    dirty = subprocess.run(
        ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    if dirty.strip():
        warnings.warn(
            "uncommitted changes are not baked (the tests bake the committed tree)", stacklevel=2
        )
    return f"git+file://{REPO}"


@pytest.fixture(scope="session")
def cookiecutter_config(tmp_path_factory) -> Path:
    """A user config that keeps cookiecutter's clones and replays out of ~."""
    home = tmp_path_factory.mktemp("cookiecutter-home")
    config = home / "config.yaml"
    config.write_text(f"cookiecutters_dir: {home / 'templates'}\nreplay_dir: {home / 'replay'}\n")
    return config


def bake(url: str, config: Path, output_dir: Path, **context: str) -> subprocess.CompletedProcess:
    """Run ``cookiecutter --no-input`` with ``key=value`` extra context."""
    output_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(BIN / "cookiecutter"),
        "--no-input",
        "--config-file",
        str(config),
        "--output-dir",
        str(output_dir),
        url,
        *(f"{key}={value}" for key, value in context.items()),
    ]
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
