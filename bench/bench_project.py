"""The baked project a bench measures. The bench belongs to the template, not to the
projects it writes, so it is pointed at one: ``--project DIR`` (a directory the
template baked; ``BENCH_PROJECT`` in the environment), passed on to every process
the bench starts. Its package is found by the template's layout (the one package
under ``src/`` with a ``contract.py``) and imported by that name; the engine is
``training_engine``."""

import argparse
import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

VARIABLE = "BENCH_PROJECT"


def add_option(parser: argparse.ArgumentParser) -> None:
    """``--project DIR`` (default: ``$BENCH_PROJECT``)."""
    default = os.environ.get(VARIABLE)
    help_ = f"the baked project to measure (default: ${VARIABLE})"
    parser.add_argument("--project", type=Path, default=default, help=help_)


def use_option(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The project of ``--project``, for this process and those it starts."""
    if args.project is None:
        parser.error(f"--project DIR: the baked project to measure (or ${VARIABLE})")
    use(args.project)


def use(project: Path) -> Path:
    """Make ``project`` the one this process and the processes it starts measure:
    its ``src/`` importable here and in them (also where it is not installed)."""
    root_dir = Path(project).resolve()
    os.environ[VARIABLE] = str(root_dir)
    src = str(root_dir / "src")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if src not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([src, *paths])
    return root()


def root() -> Path:
    """The project's directory (the one holding ``train.py`` and ``configs/``)."""
    where = os.environ.get(VARIABLE)
    if not where:
        raise SystemExit(f"bench: which project? --project DIR (a baked project) or {VARIABLE}")
    path = Path(where).resolve()
    if not (path / "train.py").is_file() or not (path / "configs").is_dir():
        raise SystemExit(f"bench: {path} is not a baked project (no train.py and configs/)")
    return path


def package_name() -> str:
    found = sorted(p.parent.name for p in (root() / "src").glob("*/contract.py"))
    if len(found) != 1:
        where = root() / "src"
        raise SystemExit(f"bench: expected one package with a contract.py in {where}: {found}")
    return found[0]


def module(name: str = "") -> ModuleType:
    """The project's ``<package>.<name>`` (``module()``: the package itself); the
    engine's for ``engine.<name>`` (``module("engine.config")``: training_engine.config)."""
    src = str(root() / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    if name == "engine" or name.startswith("engine."):
        return importlib.import_module("training_" + name)
    return importlib.import_module(".".join(filter(None, [package_name(), name])))
