"""The save protocol, all of it after the manager has staged the state: every rank
writes its files into ``step_N.tmp/``; the main process writes the manifest last,
commits (one rename), replaces the ``latest.json``/``best.json`` pointers and prunes.
The same code runs for sync saves (main thread, barriers) and ``checkpoint.async_save``
ones: the state is staged in host memory (``Stager``) and a background thread
writes and commits it with no collectives. Files are written and hashed from the
same buffers (checksums.py); their names are format.py's. docs/checkpoints.md.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import disk, moments
from ..files import fsync_dir, write_durable, write_json_atomic
from . import folder
from . import format as fmt
from .checksums import HashingWriter, threads
from .format import CheckpointError

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


def make_tmp(job: SaveJob, accelerator: Any) -> OSError | None:
    """The main process creates ``step_N.tmp/``; a barrier, then every rank writes.
    Returns the error instead of raising it: the other ranks are at the barrier."""
    failed: OSError | None = None
    try:
        if accelerator.is_main_process:
            job.root.mkdir(parents=True, exist_ok=True)
            if job.tmp.exists():
                shutil.rmtree(job.tmp)
            job.tmp.mkdir()
            for shard_dir in fmt.SHARD_DIRS if job.shards is not None else ():
                (job.tmp / shard_dir).mkdir()  # every rank writes its shards there
    except OSError as err:
        failed = err
    accelerator.wait_for_everyone()
    return failed


def write_and_commit(
    job: SaveJob,
    acc: Any,
    failed: OSError | CheckpointError | None,
    sync: bool,
    timeout_s: float,
    keep_last: int,
) -> None:
    """Every rank writes its files into ``job.tmp``; then the main process
    writes the manifest, commits (rename), replaces the pointers and prunes.

    ``sync``: barriers between the two phases (main thread). Otherwise (a
    background thread) no collectives at all: the main process waits for
    each rank's file to appear (written under a hidden name, fsynced, then
    renamed into place)."""
    files: dict[str, dict[str, Any]] = {}
    try:
        if failed is None:
            if job.copied is not None:
                job.copied.synchronize()  # the staging copies from the GPU have landed
            rng_name = fmt.rng_file(acc.process_index)
            if job.own_files is not None:  # sharded: this rank hashes the shards it wrote
                entries = {f"{p.parent.name}/{p.name}": fmt.path_entry(p) for p in job.own_files}
                hashes = job.tmp / f".files_rank{acc.process_index}.json"
                write_durable(hashes, json.dumps(entries).encode())
            hidden = job.tmp / f".{rng_name}.part"
            write_durable(hidden, job.blobs.pop(rng_name))
            hidden.replace(job.tmp / rng_name)  # after the hashes: it says they are there
            if acc.is_main_process and job.tensors:
                files = write_main_files(job.tmp, job.step, job.tensors, job.blobs)
            elif acc.is_main_process:
                files = write_blobs(job)
    except (OSError, CheckpointError) as err:  # the barrier first, then every rank raises
        failed = err
    if sync:
        acc.wait_for_everyone()
    try:
        if acc.is_main_process and failed is None:
            rank_files = [job.tmp / fmt.rng_file(r) for r in range(acc.num_processes)]
            if not sync:
                wait_for_files(rank_files, timeout_s)
            for path in rank_files:  # other ranks fsynced their own file
                data = path.read_bytes()
                files[path.name] = fmt.file_entry(data)
                hashes = path.with_name(f".files_{path.stem.removeprefix('rng_')}.json")
                if job.own_files is not None:  # the main process gathers every rank's hashes
                    files.update(json.loads(hashes.read_text()))
                    hashes.unlink()
            for shard_dir in fmt.SUBDIRS:  # DCP (DeepSpeed) fsynced the files, not their folders
                if (job.tmp / shard_dir).is_dir():
                    fsync_dir(job.tmp / shard_dir)
            commit(job.tmp, job.final, job.manifest, files)
            write_pointers(job.root, job.step, job.new_best)
    except OSError as err:
        failed = err
    if failed is not None:
        if acc.is_main_process:
            shutil.rmtree(job.tmp, ignore_errors=True)
        raise write_error(job, failed) from failed
    if acc.is_main_process and job.prune:
        best_step = job.best["step"] if job.best is not None else None
        prune(job.root, job.step, keep_last, best_step)


def write_blobs(job: SaveJob) -> dict[str, dict[str, Any]]:
    """The main process's small files of a sharded checkpoint (the shards are
    written already); returns their manifest entries."""
    files = {}
    for fname, data in job.blobs.items():
        with HashingWriter(job.tmp / fname, threads("hash")) as out:
            out.write(data)
        files[fname] = out.entry
    return files


def write_error(job: SaveJob, failed: Exception) -> CheckpointError:
    """The error a failed save raises: the disk advice for the file system's
    errors only; anything else (tensors sharing memory, a layout the format
    cannot store) is named as it is."""
    if not isinstance(failed, OSError):
        return CheckpointError(
            f"could not write checkpoint {job.name} in {job.root}: {failed}. Earlier "
            "checkpoints are intact; this is not a disk problem: the state itself could "
            "not be written in this format (checkpoint.format, docs/checkpoints.md)."
        )
    if disk.is_full(failed):
        committed = folder.committed_checkpoints(job.root) if job.root.is_dir() else []
        needed = disk.tree_bytes(committed[-1]) if committed else None
        return CheckpointError(
            f"could not write checkpoint {job.name} in {job.root}: {failed.strerror} "
            f"({failed.filename or ''}): {disk.full_disk_report(job.root, needed)}. Earlier "
            "checkpoints are intact; free space there (older runs, fewer checkpoints kept: "
            "checkpoint.keep_last) or put runs_root on a larger disk, then restart the same "
            "command to resume."
        )
    return CheckpointError(
        f"could not write checkpoint {job.name} in {job.root}: {failed.strerror or failed} "
        f"({failed.filename or ''}). Earlier checkpoints are intact; free disk space or fix "
        "permissions, then restart the same command to resume."
    )


def write_pointers(root: Path, step: int, new_best: dict[str, Any] | None) -> None:
    """``latest.json`` (and ``best.json`` for a new best), replaced atomically."""
    moments.reached("before_pointers", step)
    pointer = {"step": step, "path": folder.checkpoint_name(step)}
    write_json_atomic(root / fmt.LATEST, pointer)
    if new_best is not None:
        write_json_atomic(root / fmt.BEST, {**pointer, **new_best})
    fsync_dir(root)


def prune(root: Path, step: int, keep_last: int, best_step: int | None) -> None:
    """Remove what ``to_prune`` says; runs only after a commit. Rename first
    (atomic), then delete: a crash mid-delete leaves a ``*.tmp`` folder (removed
    at the next start), never a half checkpoint. Deleting does not block."""
    for ckpt in folder.to_prune(folder.committed_checkpoints(root), keep_last, best_step):
        doomed = ckpt.with_name(f"{ckpt.name}.pruned.tmp")
        os.replace(ckpt, doomed)
        moments.reached("pruning", step)
        threads("io").submit(shutil.rmtree, doomed, ignore_errors=True)


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


def unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU tensors for safetensors, which refuses tensors sharing memory (tied
    weights, views of one buffer): those after the first are copied. Loading
    assigns each name, so tied parameters come back tied to the same values."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen:
            tensor = tensor.clone()
        seen.add(storage)
        out[name] = tensor
    return out


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def write_safetensors(out: Any, state: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """``state`` (``unshared``) to ``out`` in the safetensors format: an 8-byte
    little-endian header length, the JSON header (padded with spaces to 8 bytes),
    then each tensor's bytes in header order; ``safetensors`` reads it. Hand-written
    because ``safetensors.torch.save`` builds the whole file as one bytes object
    first: 72-107 ms for a 76 MB model here, as long as ``torch.save`` of its 152 MB
    AdamW state. This writes each tensor's own buffer (no copy), hashed on the way."""
    assert sys.byteorder == "little", "safetensors stores little-endian"
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in state.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{name}: dtype {tensor.dtype} has no safetensors code here")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    out.write(len(text).to_bytes(8, "little") + text)
    for tensor in state.values():
        if tensor.numel():
            out.write(tensor.reshape(-1).view(torch.uint8).numpy())


def torch_save(obj: Any, out: Any) -> None:
    """torch.save without its per-record CRC32: the manifest's checksum already
    covers every byte (torch.load reads such files as usual)."""
    get_crc32 = getattr(torch.serialization, "get_crc32_options", None)  # torch >= 2.5
    if get_crc32 is None:
        torch.save(obj, out)
        return
    before = get_crc32()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(obj, out)
    finally:
        torch.serialization.set_crc32_options(before)


def torch_bytes(obj: Any) -> memoryview:
    buf = io.BytesIO()
    torch_save(obj, buf)
    return buf.getbuffer()


def write_main_files(
    tmp: Path, step: int, tensors: dict[str, Any], blobs: dict[str, bytes | memoryview]
) -> dict[str, dict[str, Any]]:
    """Serialize and write + fsync the main process's files into ``tmp``, in
    threads; returns their manifest entries. Each file is hashed from the same
    buffers as they are written, so hashing costs little time and no copy."""
    model_state, optimizer_state = tensors[fmt.MODEL], tensors.get(fmt.OPTIMIZER)
    writers = threads("io")

    def write(fname: str, serialize: Callable[[HashingWriter], Any]) -> dict[str, Any]:
        with HashingWriter(tmp / fname, threads("hash")) as out:
            serialize(out)
        return out.entry

    futures = {
        fmt.MODEL: writers.submit(
            write,
            fmt.MODEL,
            lambda out: write_safetensors(out, unshared(model_state), {"step": str(step)}),
        )
    }
    moments.reached("between_files", step)  # the model file written or in flight
    if optimizer_state is not None:  # DeepSpeed: its own files hold the optimizer (zero.py)
        futures[fmt.OPTIMIZER] = writers.submit(
            write, fmt.OPTIMIZER, lambda out: torch_save(optimizer_state, out)
        )
    for fname, data in blobs.items():
        futures[fname] = writers.submit(write, fname, lambda out, d=data: out.write(d))
    return {fname: future.result() for fname, future in futures.items()}


def commit(
    tmp: Path, final: Path, manifest: dict[str, Any], files: dict[str, dict[str, Any]]
) -> None:
    """Write MANIFEST.json (last, fsynced), then rename ``tmp`` to ``final``
    (replacing an older folder of the same step) and fsync the parent."""
    manifest = {**manifest, "files": dict(sorted(files.items()))}
    write_durable(tmp / fmt.MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    fsync_dir(tmp)
    moments.reached("before_rename", manifest["step"])
    if final.exists():  # the same step again (e.g. after a fallback)
        old = final.with_name(f"{final.name}.replaced.tmp")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)  # the commit
    fsync_dir(final.parent)
