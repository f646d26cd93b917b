"""Files that are never seen half-written, and one lock: every atomic write and
every lock file of the engine goes through here.

``write_atomic``: a reader sees the old content or the new, never half of it (a
hidden temporary file beside the target, ``temporary``, fsynced, then renamed over it).
``write_durable``: a file inside a folder that is itself renamed into place
later (a checkpoint's ``step_N.tmp/``): fsynced, no rename of its own.
``locked``: an exclusive lock held for a ``with`` block, for writers that would
otherwise race (jobs of a sweep ending together, a store's first migration).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def write_durable(path: Path, data: bytes | bytearray | memoryview | str) -> None:
    """Write and fsync ``path`` (no rename: its folder is committed by a rename)."""
    raw = data.encode() if isinstance(data, str) else data
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())


def temporary(path: Path) -> Path:
    """``.<name>.tmp`` beside ``path``: where an atomic write of ``path`` is made
    before its rename (what a write killed half-way leaves behind)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


def write_atomic(path: Path, data: bytes | bytearray | memoryview | str) -> None:
    """Replace ``path`` with ``data`` (text is UTF-8) so that readers see the old
    file or the new one, never half."""
    tmp = temporary(path)
    write_durable(tmp, data)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def locked(lock_file: Path) -> Iterator[None]:
    """An exclusive flock on ``lock_file`` (created, with its folder, if missing)
    for the block; the kernel releases it if the process dies."""
    Path(lock_file).parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield
