"""Refuse project names that would break the generated project.

Cookiecutter renders this file with Jinja before running it. Every variable is
inserted through ``tojson`` into a raw string and read back with
``json.loads``, so a value holding quotes, backslashes or Python code is only
ever data. ``tojson`` escapes ``'`` so the raw string can never be closed early.
On exit 1 cookiecutter deletes the directory it had started to create. That
directory is named by ``__project_dir`` (the slug with ``/`` replaced), not by
the raw slug: a slug holding ``/`` would otherwise create nested directories of
which cookiecutter deletes only the innermost.
"""

import json
import keyword
import sys

SLUG = json.loads(r'''{{ cookiecutter.project_slug | tojson }}''')
PACKAGE = json.loads(r'''{{ cookiecutter.package_name | tojson }}''')

# Modules the generated project imports or runs beside its package; a package
# of the same name would shadow them on sys.path.
PROJECT_MODULES = {
    "accelerate",
    "bench",
    "configs",
    "hydra",
    "mlflow",
    "numpy",
    "omegaconf",
    "optuna",
    "pytest",
    "safetensors",
    "scripts",
    "src",
    "submitit",
    "tensorboard",
    "test",
    "tests",
    "torch",
    "tqdm",
    "training_engine",
    "engine_tests",
    "train",
    "wandb",
    "deepspeed",
    "transformers",
    "rich",
    "yaml",
}


def problem(kind: str, value: str) -> str | None:
    if not value.isidentifier() or not value.isascii():
        return (
            f"{kind} {value!r} is not a Python identifier: use ASCII letters, digits "
            "and underscores, not starting with a digit (e.g. 'digit_trainer')"
        )
    if value != value.lower():
        return f"{kind} {value!r} must be lowercase (PEP 8 package names)"
    if keyword.iskeyword(value) or keyword.issoftkeyword(value):
        return f"{kind} {value!r} is a Python keyword; choose another name"
    if value in sys.stdlib_module_names or value in PROJECT_MODULES:
        return (
            f"{kind} {value!r} would shadow the module {value!r} that the project "
            "imports; choose another name"
        )
    return None


def main() -> int:
    for kind, value in (("project_slug", SLUG), ("package_name", PACKAGE)):
        message = problem(kind, value)
        if message:
            print(f"ERROR: {message}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
