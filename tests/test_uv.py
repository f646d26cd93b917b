"""A project baked with package_manager=uv, installed and run with uv's own commands.

PyTorch's indexes cannot be reached where CI runs; PyPI can, and the CPU wheel of
torch lies in the folder that PIP_FIND_LINKS names (pip finds it there, uv does not
look). So each PyTorch index the generated pyproject.toml names (pytorch-cpu,
pytorch-cu128, pytorch-cu130) is replaced, by name, with a PEP 503 simple index of
that wheel (UV_INDEX=name=url: uv's override of a named index), and everything else
comes from PyPI. Where no such wheel is found, the real indexes are used.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import quote

from .conftest import BIN, REPO, bake

TORCH = "2.13.0"  # the version the generated extras pin
INDEXES = ("pytorch-cpu", "pytorch-cu128", "pytorch-cu130")


def local_torch_wheel() -> Path | None:
    """The CPU wheel of torch TORCH for this Python in PIP_FIND_LINKS, if any."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in os.environ.get("PIP_FIND_LINKS", "").split():
        for wheel in sorted(Path(folder).glob(f"torch-{TORCH}+cpu-{tag}-{tag}-*.whl")):
            return wheel
    return None


def stand_in_indexes(wheel: Path, root: Path) -> dict[str, Path]:
    """For each PyTorch index name, a simple index (PEP 503) whose only project is
    torch with the local wheel: the page of links, its sha256, the file beside it."""
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    found = {}
    for name in INDEXES:
        page = root / name / "torch"
        page.mkdir(parents=True)
        (page / wheel.name).symlink_to(wheel)
        link = f'<a href="{quote(wheel.name)}#sha256={digest}">{wheel.name}</a>'
        (page / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>{link}</body></html>\n")
        found[name] = root / name
    return found


def uv_binary() -> str:
    uv = shutil.which("uv", path=str(BIN)) or shutil.which("uv")
    assert uv, "uv is missing: `make test` installs it (Makefile, TEST_DEPS)"
    return uv


def test_a_uv_project_syncs_runs_its_tests_and_trains_with_uvs_own_options(
    template_url, cookiecutter_config, tmp_path
):
    proc = bake(template_url, cookiecutter_config, tmp_path / "bake", package_manager="uv")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (project,) = (tmp_path / "bake").iterdir()
    uv = uv_binary()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env |= {
        "UV_PYTHON": sys.executable,  # the interpreter the local wheel is built for
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_CACHE_DIR": str(REPO / "build" / "uv-cache"),  # kept between runs
        "UV_LINK_MODE": "copy",  # the cache and tmp_path may be on different filesystems
        "UV_NO_PROGRESS": "1",
    }
    wheel = local_torch_wheel()
    indexes = stand_in_indexes(wheel, tmp_path / "indexes") if wheel else {}
    if indexes:
        env["UV_INDEX"] = " ".join(f"{name}={path.as_uri()}" for name, path in indexes.items())

    def uv_run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [uv, *args], cwd=project, env=env, capture_output=True, text=True, timeout=timeout
        )
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"uv {' '.join(args)}:\n{output[-6000:]}"
        return proc

    # The lock: one torch per extra, each from the index its extra names.
    uv_run("lock")
    lock = tomllib.loads((project / "uv.lock").read_text())
    torches = [p for p in lock["package"] if p["name"] == "torch"]
    if indexes:
        assert sorted(t["source"]["registry"] for t in torches) == sorted(
            str(path) for path in indexes.values()
        )
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        assert {t["version"] for t in torches} == {f"{TORCH}+cpu"}
        assert all(w["hash"] == f"sha256:{digest}" for t in torches for w in t["wheels"])

    def torch_index(*extras: str) -> str:
        """The index `uv sync` would take torch from, with these extras."""
        flags = [f"--extra={e}" for e in extras]
        exported = tomllib.loads(uv_run("export", "--format", "pylock.toml", *flags).stdout)
        (torch,) = [p for p in exported["packages"] if p["name"] == "torch"]
        return torch["index"]

    if indexes:
        assert torch_index("cpu") == indexes["pytorch-cpu"].as_uri()
        assert torch_index("cu130") == indexes["pytorch-cu130"].as_uri()
        assert torch_index("cu128") == indexes["pytorch-cu128"].as_uri()
        # No extra (what a bare `uv run` syncs): the cpu index (README, "Installing torch")
        assert torch_index() == indexes["pytorch-cpu"].as_uri()

    # The README's commands: uv sync --extra cpu, uv run pytest, uv run train.py.
    uv_run("sync", "--extra", "cpu")
    python = project / ".venv" / "bin" / "python"
    probe = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__); print(torch.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    version, location = probe.stdout.split()
    assert version == f"{TORCH}+cpu"
    assert Path(location).is_relative_to(project / ".venv")
    (dist_info,) = (project / ".venv").glob(
        f"lib/python*/site-packages/torch-{TORCH}+cpu.dist-info"
    )
    assert (dist_info / "INSTALLER").read_text().strip() == "uv"

    # The dev group came with it: jsonschema and hadolint for the Kubernetes tests, which
    # also find the project's Hydra plugins in the uv-installed package.
    # The engine, locked at the pin's commit (a git source: the template's URL).
    (engine,) = [p for p in lock["package"] if p["name"] == "training-engine"]
    assert "#" + template_url.removeprefix("git+") not in engine["source"]["git"]
    assert engine["source"]["git"].startswith(template_url.removeprefix("git+"))
    selection = ["-m", "not multiprocess", "tests/test_configs.py"]
    out = uv_run("run", "pytest", "-q", "-p", "no:cacheprovider", *selection).stdout
    assert " passed" in out and " failed" not in out and " skipped" not in out, out[-3000:]

    run = ["train.py", "trainer.max_steps=5", "tracker=csv", "preflight=off", "run_name=uv"]
    uv_run("run", *run)
    summary = json.loads((project / "runs" / "uv" / "summary.json").read_text())
    assert summary["step"] == 5 and summary["world_size"] == 1
