"""``python -m training_engine eject``: copy the engine's source into the project and
depend on that copy instead of the pinned release. The project then owns its engine
(nanochat-style): edit it freely; updates no longer arrive through the pin.

What it does, in the project's folder (the current one, or ``--project``):

- copies this engine's package to ``src/training_engine/`` and its Hydra plugins to
  ``src/hydra_plugins/training_engine_*/``;
- in ``pyproject.toml``, replaces the engine's pin with the engine's own dependencies
  and lets setuptools find the plugins' namespace package;
- writes ``src/training_engine/EJECTED.json``: the version and where it came from.

Refused (exit 2, nothing changed) when the project has no pin to replace or already
holds an engine.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from importlib import metadata
from pathlib import Path

from .version import __version__

DIST = "training-engine"
PACKAGE = Path(__file__).resolve().parent
PLUGINS = PACKAGE.parent / "hydra_plugins"
# The pin, and the comment line above it if it has one.
PIN = re.compile(
    r'^(?:[ \t]*#[^\n]*\n)?([ \t]*)"training-engine(\s*@[^"]*|[=<>!~][^"]*|)",?[^\n]*\n',
    re.MULTILINE,
)


class EjectError(Exception):
    """Why the project cannot be ejected (exit 2)."""


def engine_requirements() -> list[str]:
    """The engine's own runtime dependencies (not its extras), as its metadata has them."""
    try:
        found = metadata.requires(DIST) or []
    except metadata.PackageNotFoundError:
        found = []
    return [r for r in found if "extra ==" not in r]


def eject(project: Path) -> list[str]:
    """Eject into ``project``; the paths written, relative to it."""
    pyproject = project / "pyproject.toml"
    if not pyproject.is_file():
        raise EjectError(f"{project}: no pyproject.toml (run it in the project's folder)")
    target = project / "src" / "training_engine"
    if target.exists():
        raise EjectError(f"{target} exists: the project already holds an engine")
    text = pyproject.read_text()
    match = PIN.search(text)
    if not match:
        raise EjectError(f"{pyproject}: no dependency on {DIST} to replace")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(PACKAGE, target, ignore=ignore)
    written = [str(target.relative_to(project))]
    for plugin in sorted(PLUGINS.glob("training_engine_*")):
        copy = project / "src" / "hydra_plugins" / plugin.name
        shutil.copytree(plugin, copy, ignore=ignore)
        written.append(str(copy.relative_to(project)))
    indent = match.group(1)
    lines = [f"{indent}# The engine, ejected from {DIST} {__version__}: src/training_engine/."]
    listed = set(re.findall(r'^\s*"([A-Za-z0-9_.-]+)', text, re.MULTILINE))
    lines += [
        f'{indent}"{req}",'
        for req in engine_requirements()
        if re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0] not in listed  # the project's own
    ]
    text = text[: match.start()] + "\n".join(lines) + "\n" + text[match.end() :]
    text = text.replace("namespaces = false", "namespaces = true  # src/hydra_plugins/")
    pyproject.write_text(text)
    origin = {"version": __version__, "from": str(PACKAGE)}
    (target / "EJECTED.json").write_text(json.dumps(origin, indent=2) + "\n")
    return written


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m training_engine eject",
        description="Copy the engine into the project, which then owns it.",
    )
    parser.add_argument("--project", type=Path, default=Path.cwd(), help="default: here")
    args = parser.parse_args(argv)
    try:
        written = eject(args.project.resolve())
    except EjectError as err:
        print(f"eject: {err}", file=sys.stderr)
        return 2
    print("ejected training-engine " + __version__ + ":\n  " + "\n  ".join(written))
    print(
        "Next: pip uninstall -y training-engine && pip install -e '.[dev]'   "
        "(the project's copy replaces the release)"
    )
    return 0
