"""eval.py, predict.py and generate.py compose their config before reading the run's,
so ``data.val_dir=...`` for a run trained with ``data=images`` would meet the default
data option's keys and be refused. Before Hydra composes, ``with_runs_data_option``
adds the run's own ``data=<option>`` to the command line (unless one is given): the
option of this project's ``configs/data/`` whose ``_target_`` is the run's.

The run dir only supplies a string compared for equality with the project's own
files: it names no file, code or option that the project does not already have.
"""

from __future__ import annotations

from pathlib import Path

from .trust import Malformed, read_json


def with_runs_data_option(argv: list[str], config_dir: Path) -> list[str]:
    """``argv`` with ``data=<the run's option>`` added when it gives ``ckpt=`` and a
    ``data.KEY=`` override but no ``data=``; else ``argv`` as it is."""
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    keys = [a.split("=", 1)[0].lstrip("+~") for a in overrides]
    ckpt = next((a.split("=", 1)[1] for a in overrides if a.startswith("ckpt=")), None)
    if ckpt is None or "data" in keys or not any(k.startswith("data.") for k in keys):
        return argv
    target = _run_data_target(Path(ckpt))
    options = _options_with_target(config_dir / "data", target) if target else []
    if len(options) != 1:  # unknown, or ambiguous: Hydra's own message says what is wrong
        return argv
    return [f"data={options[0]}", *argv]


def _run_data_target(ckpt: Path) -> str | None:
    for folder in (ckpt, ckpt.parent, ckpt.parent.parent):
        config = folder / "config.json"
        if config.is_file():
            try:
                saved = read_json(config)
            except Malformed:
                return None
            data = saved.get("data") if isinstance(saved, dict) else None
            target = data.get("_target_") if isinstance(data, dict) else None
            return target if isinstance(target, str) else None
    return None


def _options_with_target(group: Path, target: str) -> list[str]:
    from omegaconf import OmegaConf

    found = []
    for path in sorted(group.glob("*.yaml")) if group.is_dir() else []:
        try:
            node = OmegaConf.load(path)
        except Exception:  # a project file that does not parse: not the run's option
            continue
        if OmegaConf.is_dict(node) and node.get("_target_") == target:
            found.append(path.stem)
    return found
