"""``checkpoint.async=true``: stage the state in host memory, write it in a thread.

``save`` copies the state into CPU buffers (reused between saves; page-locked,
without waiting, from a GPU) and returns; a background thread writes and, on the
main process, commits it with the same protocol. Collectives stay in the main
thread; at most one save is in flight. docs/checkpoints.md.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass
class SaveJob:
    """One checkpoint on its way to disk: what it holds, staged, and (async)
    the thread writing it."""

    name: str
    step: int
    root: Path
    tmp: Path
    final: Path
    reasons: list[str]
    new_best: dict[str, Any] | None
    best: dict[str, Any] | None
    manifest: dict[str, Any]  # all but "files"
    tensors: dict[str, Any]  # file name -> state holding tensors (main process)
    blobs: dict[str, bytes | memoryview]  # file name -> serialized small file
    prune: bool = True  # False for scratch saves (preflight)
    # checkpoint.format=sharded: this rank's live state (sharded.state_dicts), which
    # every rank writes in the main thread, and then the shard files it wrote.
    shards: tuple[dict, dict] | None = None
    own_files: list[Path] | None = None
    copied: Any = None  # a CUDA event: the staging copies have landed
    thread: threading.Thread | None = None
    error: BaseException | None = None


class Stager:
    """Copies a state (nested dicts/lists of tensors) into CPU buffers that the
    training never touches, reusing the buffers of the previous save (no new
    allocations, no page faults). From a GPU: into page-locked memory, without
    waiting (the returned CUDA event says when the copies have landed)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def copy(self, tree: Any) -> tuple[Any, Any]:
        on_gpu: list = []
        copied = self._copy(tree, (), on_gpu)
        event = None
        if on_gpu:
            event = torch.cuda.Event()
            event.record()
        return copied, event

    def _copy(self, tree: Any, path: tuple, on_gpu: list) -> Any:
        if isinstance(tree, torch.Tensor):
            tensor = tree.detach()
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                pin = tensor.device.type == "cuda"
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
                self._buffers[path] = buffer
            if tensor.device.type == "cuda":
                on_gpu.append(path)
            buffer.copy_(tensor, non_blocking=True)
            return buffer
        if isinstance(tree, dict):
            return {k: self._copy(v, (*path, k), on_gpu) for k, v in tree.items()}
        if isinstance(tree, list | tuple):
            return type(tree)(self._copy(v, (*path, i), on_gpu) for i, v in enumerate(tree))
        return copy.deepcopy(tree)


def start(job: SaveJob, write: Any, announce: bool) -> None:
    """Run ``write(job)`` in a background thread; an error is kept in ``job.error``
    for ``join`` (the main thread) to raise. ``announce``: log the saved checkpoint."""

    def run() -> None:
        try:
            write(job)
        except BaseException as err:  # handed to the main thread by join()
            job.error = err
            log.error(f"checkpoint {job.name} failed in the background: {err}")
            return
        if announce:
            log.info(f"checkpoint saved: {job.final} ({', '.join(job.reasons)}; async)")

    job.thread = threading.Thread(target=run, name=f"checkpoint-{job.name}")
    job.thread.start()


def join(job: SaveJob) -> BaseException | None:
    """Wait for the job's thread; its error, if it failed."""
    job.thread.join()
    return job.error


def wait_for_files(paths: list[Path], timeout: float) -> None:
    """Async saves under several processes, main process: until every rank's
    file exists (each rank writes its own under a hidden name, then renames it:
    no collective runs off the main thread)."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if not threading.main_thread().is_alive():  # the run failed: nothing to wait for
            raise TimeoutError(f"the run ended before every rank wrote {paths[0].parent}")
        if time.monotonic() > deadline:
            missing = ", ".join(p.name for p in paths if not p.exists())
            raise TimeoutError(f"after {timeout:.0f} s still missing: {missing}")
        time.sleep(0.01)
