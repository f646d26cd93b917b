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

NOT_CHOSEN = {
    "LICENSE": LICENSE == "Proprietary",
    "configs/hydra/launcher/slurm.yaml": INCLUDE_SLURM != "yes",
    "tests/test_slurm.py": INCLUDE_SLURM != "yes",
    "tests/slurm": INCLUDE_SLURM != "yes",
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


def launch_dir() -> Path:
    """Where cookiecutter was run (this hook runs in the new project): a relative
    template path is relative to it."""
    try:
        return Path(os.readlink(f"/proc/{os.getppid()}/cwd"))
    except OSError:
        return Path(os.environ.get("PWD", "."))


def template_url(template: str) -> str:
    """The template as ``git clone`` takes it: no ``git+`` prefix, no abbreviation,
    a local path made absolute."""
    template = template.removeprefix("git+")
    for short, long in ABBREVIATIONS.items():
        if template.startswith(short):
            return long + template.removeprefix(short)
    if "://" in template or "@" in template.split("/")[0]:
        return template
    return str((launch_dir() / template).resolve())


def template_commit(repo_dir: str | None) -> str | None:
    """The commit the project was baked from (the clone or local checkout's HEAD)."""
    if not repo_dir:
        return None
    proc = subprocess.run(
        ["git", "-C", repo_dir, "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    return proc.stdout.strip() or None


def write_cruft_state(root: Path) -> None:
    """``.cruft.json`` as ``cruft create`` writes it, so that ``cruft check`` and
    ``cruft update`` work on a project baked with plain cookiecutter. Under cruft
    (its context has ``_commit``) cruft writes the file itself."""
    if "_commit" in CONTEXT:
        return
    url = template_url(CONTEXT["_template"])
    repo_dir = CONTEXT.get("_repo_dir")
    if repo_dir and not Path(repo_dir).is_absolute():
        repo_dir = str(launch_dir() / repo_dir)
    commit = template_commit(repo_dir)
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
    write_cruft_state(root)
    steps = "".join(f"  {line}\n" for line in [f"cd {SLUG}", *NEXT_STEPS])
    print(f"\nCreated {root}\n\nNext steps:\n{steps}")


if __name__ == "__main__":
    main()
