"""The checkpoints folder, read: step names, which checkpoints a path names, the
``latest.json``/``best.json`` pointers, which checkpoints pruning removes (keep
last N and the best), and the clean-up of interrupted saves and of a superseded
timeline. Writing the pointers and pruning are save.py's. docs/checkpoints.md.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from .. import trust
from . import format as fmt

STEP_DIR = re.compile(r"^step_(\d+)$")
MIN_KEEP = 2  # checkpoint.keep_last below this is raised: the newest may be half-written


def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}"


def step_of(path: Path) -> int | None:
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def committed_checkpoints(root: Path) -> list[Path]:
    """``step_*`` folders in ``root`` (no ``*.tmp``), oldest first. A symlink named
    like one is listed too: reading it fails (format.read_manifest), which reports
    it and falls back, rather than hiding it."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None and (p.is_dir() or p.is_symlink())]
    return sorted(found, key=step_of)


def read_pointer(root: Path, name: str) -> Path:
    """The checkpoint a pointer (``latest.json``, ``best.json``) of ``root`` names:
    a ``step_*`` entry of the same ``root``, nothing else (no path, no ``..``).
    CheckpointError when the pointer is missing or says anything else."""
    path = root / name
    try:
        target = trust.inside(trust.read_json(path, max_bytes=1 << 16)["path"], root)
    except (trust.Malformed, KeyError, TypeError) as err:
        raise fmt.CheckpointError(
            f"{path}: not a pointer to a checkpoint of {root} ({err})"
        ) from err
    if step_of(target) is None:
        raise fmt.CheckpointError(f"{path}: names {target.name!r}, not a step_* checkpoint")
    return target


def find_checkpoints(path: Path) -> list[Path]:
    """What a path names: one checkpoint, or the committed ones of a
    checkpoints dir or of a run dir (oldest first)."""
    if not path.exists():
        raise fmt.CheckpointError(f"{path}: no such file or directory")
    if path.name.endswith(".tmp"):
        raise fmt.CheckpointError(f"{path}: an unfinished save, not a checkpoint")
    if step_of(path) is not None or (path / fmt.MANIFEST).exists():
        return [path]  # exactly this checkpoint
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    return committed_checkpoints(root)


def to_prune(ckpts: list[Path], keep_last: int, best_step: int | None) -> list[Path]:
    """Which committed checkpoints (oldest first) pruning removes: all but the
    ``keep_last`` (at least MIN_KEEP) newest and the best; never the newest."""
    keep = {p.name for p in ckpts[-max(MIN_KEEP, keep_last) :]}
    if best_step is not None:
        keep.add(checkpoint_name(best_step))
    return [ckpt for ckpt in ckpts[:-1] if ckpt.name not in keep]


def remove_stale_tmp(root: Path) -> list[Path]:
    """Remove what interrupted saves left (``*.tmp``); returns the folders removed."""
    if not root.is_dir():
        return []
    removed = []
    for path in root.glob("*.tmp"):
        removed.append(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    for path in root.glob(".*.tmp"):
        path.unlink(missing_ok=True)
    return removed


def set_aside_newer_than(root: Path, step: int) -> list[tuple[Path, Path]]:
    """Rename (never delete) the checkpoints newer than ``step``, so that resuming
    and pruning never mix two timelines. Returns (old, new) paths."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for ckpt in committed_checkpoints(root):
        if step_of(ckpt) > step:
            target = ckpt.with_name(f"{ckpt.name}.superseded-{stamp}")
            os.replace(ckpt, target)
            moved.append((ckpt, target))
    return moved
