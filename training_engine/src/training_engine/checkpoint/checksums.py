"""Checksums of checkpoint files: the algorithm, manifest entries naming it,
and the writer that hashes a file from the buffers it writes.

The checksum is XXH3-128 (``HASH``), chosen by measurement (the template's bench/; ~5 GB/s
on one core against ~0.5 GB/s for sha256 and ~1.4 GB/s for multi-threaded
BLAKE3 on the 2-core machine of issue 18): it guards against corruption, which
is its purpose; the manifest is not signed, and a forged file is defeated by
safe loading, not by the hash. Each manifest entry names its algorithm
(``{"xxh3_128": ..., "size": ...}``); older manifests' ``sha256`` entries still verify.
"""

from __future__ import annotations

import functools
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

HASH = "xxh3_128"  # what new checkpoints use; HASHES: what a manifest entry may name
HASHES: dict[str, Any] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}


@functools.cache
def threads(kind: str) -> ThreadPoolExecutor:
    """Long-lived worker threads, one pool per ``kind`` ("io": writing files,
    "hash": hashing; separate, so writers can wait for hashes without a
    deadlock). Starting threads for every save would cost more than hashing."""
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"checkpoint-{kind}")


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()  # releases the GIL: runs beside writes


def digest(data: bytes | memoryview) -> str:
    """The ``HASH`` of ``data`` (xxhash releases the GIL: runs beside writes)."""
    return HASHES[HASH](data).hexdigest()


def file_entry(data: bytes | memoryview) -> dict[str, Any]:
    """The manifest entry of a file holding ``data``."""
    return {HASH: digest(data), "size": memoryview(data).nbytes}


def path_entry(path: Path) -> dict[str, Any]:
    """The manifest entry of a file already on disk (a rank's DCP shard), hashed
    in chunks: the file is never held in memory whole."""
    hasher = HASHES[HASH]()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            hasher.update(chunk)
            size += len(chunk)
    return {HASH: hasher.hexdigest(), "size": size}


def entry_hash(entry: dict[str, Any]) -> tuple[str, str]:
    """(algorithm, hex digest) of a manifest entry; ValueError when it names none we know."""
    named = [name for name in HASHES if isinstance(entry.get(name), str)]
    if len(named) != 1:
        raise ValueError(f"an entry needs one checksum of {', '.join(HASHES)}: {entry!r}")
    return named[0], entry[named[0]]


class HashingWriter:
    """A file being written that hashes what passes through it, from the same
    buffers: large ones are hashed in ``hashers`` while this thread writes them
    (hashlib and file writes release the GIL), so hashing adds little time. On
    exit (no error) the file is fsynced; ``entry`` is its manifest entry."""

    def __init__(self, path: Path, hashers: ThreadPoolExecutor) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 (closed by __exit__)
        self._digest = HASHES[HASH]()
        self._hashers = hashers
        self._size = 0
        self.entry: dict[str, Any] = {}

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= 1 << 20:
            hashed = self._hashers.submit(self._digest.update, view)
            self._file.write(view)
            hashed.result()
        else:
            self._digest.update(view)
            self._file.write(view)
        self._size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._file.flush()

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, error_type: Any, *_: Any) -> None:
        try:
            if error_type is None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self.entry = {HASH: self._digest.hexdigest(), "size": self._size}
        finally:
            self._file.close()
