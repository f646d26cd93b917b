"""Remove the files of options that were not chosen and print the next steps.

Runs inside the freshly generated project directory. No network access.
"""

import json
import shutil
from pathlib import Path

LICENSE = json.loads(r'''{{ cookiecutter.license | tojson }}''')
INCLUDE_SLURM = json.loads(r'''{{ cookiecutter.include_slurm | tojson }}''')
SLUG = json.loads(r'''{{ cookiecutter.project_slug | tojson }}''')

NOT_CHOSEN = {
    "LICENSE": LICENSE == "Proprietary",
    "configs/hydra/launcher/slurm.yaml": INCLUDE_SLURM != "yes",
    "tests/test_slurm.py": INCLUDE_SLURM != "yes",
    "tests/slurm": INCLUDE_SLURM != "yes",
}


def main() -> None:
    root = Path.cwd()
    for relative, remove in NOT_CHOSEN.items():
        path = root / relative
        if remove and path.is_dir():
            shutil.rmtree(path)
        elif remove and path.exists():
            path.unlink()
    print(
        f"\nCreated {root}\n\nNext steps:\n"
        f"  cd {SLUG}\n"
        "  python3 -m venv .venv && . .venv/bin/activate\n"
        "  pip install torch==2.13.0   # or the CUDA build for your machine\n"
        "  pip install -e '.[dev]'\n"
        "  python train.py            # train the example task\n"
        "  pytest                     # run the project's tests\n"
    )


if __name__ == "__main__":
    main()
