"""Remove the files of options that were not chosen, record the template's origin
for cruft (``.cruft.json``) and print the next steps.

Runs inside the freshly generated project directory. No network access.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

LICENSE = json.loads(r'''{{ cookiecutter.license | tojson }}''')
INCLUDE_SLURM = json.loads(r'''{{ cookiecutter.include_slurm | tojson }}''')
SLUG = json.loads(r'''{{ cookiecutter.project_slug | tojson }}''')
PACKAGE_MANAGER = json.loads(r'''{{ cookiecutter.package_manager | tojson }}''')
CONTEXT = json.loads(r'''{{ cookiecutter | tojson }}''')

# The engine the project depends on (training_engine/ in the template's repository).
ENGINE = "training-engine"
ENGINE_DIR = "training_engine"
ENGINE_PLACEHOLDER = "training-engine @ ENGINE-PIN"

NOT_CHOSEN = {
    "LICENSE": LICENSE == "Proprietary",
    "configs/hydra/launcher/slurm.yaml": INCLUDE_SLURM != "yes",
    "docs/slurm.md": INCLUDE_SLURM != "yes",
}


# The same lines as the project README's "Set up and run" (a bake test keeps them equal).
NEXT_STEPS_PIP = [
    "python3 -m venv .venv && . .venv/bin/activate",
    'pip install torch==2.13.0   # first; CPU wheel or CUDA build: README.md, "Installing torch"',
    "pip install -e '.[dev]'",
    "python train.py            # train the example task",
    "pytest -n auto             # run the project's tests, one per CPU core (-n 0: in turn)",
]
NEXT_STEPS_UV = [
    'uv sync --extra cpu        # CUDA: --extra cu130 (also on uv run): "Installing torch"',
    "uv run train.py            # train the example task",
    "uv run pytest -n auto      # run the project's tests, one per CPU core (-n 0: in turn)",
]
NEXT_STEPS = NEXT_STEPS_UV if PACKAGE_MANAGER == "uv" else NEXT_STEPS_PIP

# cookiecutter's abbreviations, written out: cruft clones the template with git
ABBREVIATIONS = {
    "gh:": "https://github.com/",
    "gl:": "https://gitlab.com/",
    "bb:": "https://bitbucket.org/",
}


def local_template(path: str) -> Path | None:
    """The template folder a relative or absolute local path names. cookiecutter runs
    this hook from inside the template (its process's working directory is the
    template's folder), so a relative path is tried against the shell's directory
    (PWD, which a chdir does not change) and then taken as that folder itself."""
    given = Path(path)
    if given.is_absolute():
        return given.resolve()
    try:
        inside = Path(os.readlink(f"/proc/{os.getppid()}/cwd"))
    except OSError:
        inside = None
    for base in (os.environ.get("PWD"), inside):
        if base and (Path(base) / given / "cookiecutter.json").is_file():
            return (Path(base) / given).resolve()
    if inside and (inside / "cookiecutter.json").is_file():
        return inside.resolve()
    return None


def template_url(template: str) -> str:
    """The template as ``git clone`` takes it: no ``git+`` prefix, no abbreviation,
    a local path made absolute."""
    template = template.removeprefix("git+")
    for short, long in ABBREVIATIONS.items():
        if template.startswith(short):
            return long + template.removeprefix(short)
    if "://" in template or "@" in template.split("/")[0]:
        return template
    folder = local_template(template)
    return str(folder) if folder else template


def template_commit(repo_dir: str | None) -> str | None:
    """The commit the project was baked from (the clone or local checkout's HEAD)."""
    if not repo_dir:
        return None
    proc = subprocess.run(
        ["git", "-C", repo_dir, "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    return proc.stdout.strip() or None


def template_source() -> tuple[str, str | None, Path | None]:
    """The template's URL as ``git clone`` takes it, the commit baked, and the local
    folder cookiecutter read it from (its clone of a URL, or the folder itself)."""
    url = template_url(CONTEXT["_template"])
    repo_dir = local_template(CONTEXT["_repo_dir"]) if CONTEXT.get("_repo_dir") else None
    # Under cruft (create, update) its context names the commit it renders.
    commit = CONTEXT.get("_commit") or template_commit(str(repo_dir) if repo_dir else None)
    return url, commit, repo_dir


def engine_pin(url: str, commit: str | None, repo_dir: Path | None) -> str:
    """The project's exact dependency on the engine (docs/updates.md): from a git URL,
    the same URL and commit ``.cruft.json`` records; from a local folder, that
    folder's ``training_engine/``; else the released version, from a package index."""
    if "://" in url and commit:
        # file:///path as file://localhost/path: git reads both, and a requirement's URL
        # needs a host (packaging refuses git+file:///..., so pip does)
        if url.startswith("file:///"):
            url = "file://localhost/" + url.removeprefix("file:///")
        return f"{ENGINE} @ git+{url}@{commit}#subdirectory={ENGINE_DIR}"
    local = repo_dir is not None and (repo_dir / ENGINE_DIR / "pyproject.toml").is_file()
    if local and "://" not in url:
        return f"{ENGINE} @ {(repo_dir / ENGINE_DIR).resolve().as_uri()}"
    if local:
        return f"{ENGINE}=={engine_version(repo_dir)}"
    return ENGINE


def engine_version(repo_dir: Path) -> str:
    """The engine's version, from its one place (training_engine/version.py)."""
    text = (repo_dir / ENGINE_DIR / "src" / ENGINE_DIR / "version.py").read_text()
    return text.split('__version__ = "', 1)[1].split('"', 1)[0]


def write_engine_pin(root: Path, pin: str) -> None:
    """Put the pin where the project's pyproject.toml holds the placeholder line."""
    pyproject = root / "pyproject.toml"
    text = pyproject.read_text()
    assert ENGINE_PLACEHOLDER in text, "pyproject.toml lost the engine's placeholder"
    pyproject.write_text(text.replace(ENGINE_PLACEHOLDER, pin))


def write_cruft_state(root: Path) -> None:
    """``.cruft.json`` as ``cruft create`` writes it, so that ``cruft check`` and
    ``cruft update`` work on a project baked with plain cookiecutter. Under cruft
    (its context has ``_commit``) cruft writes the file itself."""
    if "_commit" in CONTEXT:
        return
    url, commit, _ = template_source()
    # Machine-local paths of this bake are not part of the project's state.
    local = ("_output_dir", "_repo_dir", "_checkout")
    context = {k: v for k, v in CONTEXT.items() if k not in local}
    context.update(_template=url, _commit=commit)
    state = {
        "template": url,
        "commit": commit,
        "checkout": CONTEXT.get("_checkout"),
        "context": {"cookiecutter": context},
        "directory": None,
    }
    (root / ".cruft.json").write_text(json.dumps(state, ensure_ascii=False, indent=2) + "\n")


def main() -> None:
    root = Path.cwd()
    for relative, remove in NOT_CHOSEN.items():
        path = root / relative
        if remove and path.is_dir():
            shutil.rmtree(path)
        elif remove and path.exists():
            path.unlink()
    write_engine_pin(root, engine_pin(*template_source()))
    write_cruft_state(root)
    steps = "".join(f"  {line}\n" for line in [f"cd {SLUG}", *NEXT_STEPS])
    print(f"\nCreated {root}\n\nNext steps:\n{steps}")


if __name__ == "__main__":
    main()
