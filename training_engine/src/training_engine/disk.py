"""What a full disk is, said plainly: the file system a path is on (its mount point
and type), how much it has free, and how much a checkpoint of this run takes. Read
from the system (``os.statvfs``, ``/proc/mounts``); nothing is written."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

MIB = 1024 * 1024


def is_full(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def mount_of(path: Path) -> tuple[Path, str]:
    """(mount point, file system type) of the file system ``path`` is on."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    kind = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1] == str(path):
                kind = parts[2]  # the last mount there wins, as the kernel's does
    return path, kind


def free_bytes(path: Path) -> tuple[int, int]:
    """(free bytes for an unprivileged writer, total bytes) of ``path``'s file system."""
    path = Path(path)
    while not path.exists():
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def full_disk_report(path: Path, needed: int | None) -> str:
    """``the disk is full: the file system mounted at M (tmpfs) has F MiB free of T MiB;
    ... needs about N MiB``, for a write under ``path`` that ran out of space."""
    mount, kind = mount_of(path)
    free, total = free_bytes(path)
    need = f"; one checkpoint of this run takes about {needed / MIB:.1f} MiB" if needed else ""
    return (
        f"the disk is full: the file system mounted at {mount} ({kind}) has "
        f"{free / MIB:.1f} MiB free of {total / MIB:.1f} MiB{need}"
    )
