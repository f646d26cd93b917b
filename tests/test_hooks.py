"""Bad names are refused with one clear line, leaving nothing on disk, and
values are never executed as code."""

import json
import os
import subprocess
import tomllib

import pytest

from .conftest import BIN, REPO, bake


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ({"project_slug": "my-project"}, "project_slug 'my-project' is not a Python identifier"),
        ({"project_slug": "2fast"}, "project_slug '2fast' is not a Python identifier"),
        ({"project_slug": "class"}, "project_slug 'class' is a Python keyword"),
        ({"project_slug": "json"}, "project_slug 'json' would shadow the module 'json'"),
        ({"package_name": "torch"}, "package_name 'torch' would shadow the module 'torch'"),
        ({"package_name": "hydra"}, "package_name 'hydra' would shadow the module 'hydra'"),
        (
            {"package_name": "training_engine"},
            "package_name 'training_engine' would shadow the module 'training_engine'",
        ),
        ({"package_name": "test"}, "package_name 'test' would shadow the module 'test'"),
        ({"project_slug": "MyProject"}, "project_slug 'MyProject' must be lowercase"),
        ({"project_slug": "../escaped"}, "project_slug '../escaped' is not a Python identifier"),
    ],
)
def test_bad_names_are_refused_and_leave_nothing(
    template_url, cookiecutter_config, tmp_path, context, message
):
    out = tmp_path / "out"
    proc = bake(template_url, cookiecutter_config, out, **context)
    assert proc.returncode != 0
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if message in line]
    assert len(ours) == 1 and ours[0].startswith(f"ERROR: {message}"), ours
    assert list(out.iterdir()) == []
    assert not (tmp_path / "escaped").exists()


def test_values_are_data_not_code(template_url, cookiecutter_config, tmp_path):
    marker = tmp_path / "pwned"
    payload = f"x'''); __import__('os').system('touch {marker}'); ('"
    out = tmp_path / "out"
    proc = bake(template_url, cookiecutter_config, out, project_slug=payload)
    assert proc.returncode != 0
    assert "is not a Python identifier" in proc.stdout + proc.stderr
    assert not marker.exists()
    assert list(out.iterdir()) == []

    # The same payload in free-text fields bakes fine and stays text.
    description = f'"""{payload}\\" \\n'
    proc = bake(
        template_url, cookiecutter_config, out, description=description, author_name=payload
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not marker.exists()
    (project,) = out.iterdir()
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert meta["description"] == description
    assert meta["authors"][0]["name"] == payload


def baked_origin(project) -> tuple[dict, str]:
    """``.cruft.json`` and the engine pin of the project's pyproject.toml."""
    deps = tomllib.loads((project / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("training-engine")]
    return json.loads((project / ".cruft.json").read_text()), pin


@pytest.mark.parametrize("form", ["relative path", "absolute path", "git URL"])
def test_the_origin_and_the_engine_pin_name_the_template_whatever_its_form(
    template_url, cookiecutter_config, tmp_path, form
):
    """cruft can update the project (``.cruft.json``: the template's absolute path or
    URL, the commit baked) and pip can install it (the engine pinned at the same
    place), from a relative path too: cookiecutter runs the hook from inside the
    template, where a relative path means something else."""
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    launch = tmp_path / "launch"
    launch.mkdir()
    given = {
        "relative path": os.path.relpath(REPO, launch),
        "absolute path": str(REPO),
        "git URL": template_url,
    }[form]
    cmd = [str(BIN / "cookiecutter"), "--no-input", "--config-file", str(cookiecutter_config)]
    proc = subprocess.run(
        [*cmd, "-o", "out", given],
        cwd=launch,
        env={**os.environ, "PWD": str(launch)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (project,) = (launch / "out").iterdir()
    state, pin = baked_origin(project)
    assert state["commit"] == head
    if form == "git URL":
        assert state["template"] == template_url.removeprefix("git+")
        url = template_url.replace("git+file:///", "git+file://localhost/")  # a host: pip's need
        assert pin == f"training-engine @ {url}@{head}#subdirectory=training_engine"
    else:
        assert state["template"] == str(REPO)
        assert pin == f"training-engine @ {(REPO / 'training_engine').as_uri()}"
