"""Bad names are refused with one clear line, leaving nothing on disk, and
values are never executed as code."""

import tomllib

import pytest

from .conftest import bake


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ({"project_slug": "my-project"}, "project_slug 'my-project' is not a Python identifier"),
        ({"project_slug": "2fast"}, "project_slug '2fast' is not a Python identifier"),
        ({"project_slug": "class"}, "project_slug 'class' is a Python keyword"),
        ({"project_slug": "json"}, "project_slug 'json' would shadow the module 'json'"),
        ({"package_name": "torch"}, "package_name 'torch' would shadow the module 'torch'"),
        ({"package_name": "hydra"}, "package_name 'hydra' would shadow the module 'hydra'"),
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
