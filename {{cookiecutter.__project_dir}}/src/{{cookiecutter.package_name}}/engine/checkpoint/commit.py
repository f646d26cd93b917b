"""The writing half of the save protocol: every rank writes its files into
``step_N.tmp/``, then the main process writes the manifest, commits (rename),
replaces the pointers and prunes. The same code runs for sync saves (main
thread, barriers) and async ones (a background thread, no collectives).
docs/checkpoints.md.
"""

import json
import shutil
from typing import Any

from . import async_save, folder
from . import format as fmt
from .format import CheckpointError


def make_tmp(job: async_save.SaveJob, accelerator: Any) -> OSError | None:
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
    job: async_save.SaveJob,
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
            rng_name = f"rng_rank{acc.process_index}.pt"
            if job.own_files is not None:  # sharded: this rank hashes the shards it wrote
                entries = {f"{p.parent.name}/{p.name}": fmt.path_entry(p) for p in job.own_files}
                hashes = job.tmp / f".files_rank{acc.process_index}.json"
                fmt.write_file(hashes, json.dumps(entries).encode())
            hidden = job.tmp / f".{rng_name}.part"
            fmt.write_file(hidden, job.blobs.pop(rng_name))
            hidden.replace(job.tmp / rng_name)  # after the hashes: it says they are there
            if acc.is_main_process and job.tensors:
                files = fmt.write_main_files(job.tmp, job.step, job.tensors, job.blobs)
            elif acc.is_main_process:
                files = write_blobs(job)
    except (OSError, CheckpointError) as err:  # the barrier first, then every rank raises
        failed = err
    if sync:
        acc.wait_for_everyone()
    try:
        if acc.is_main_process and failed is None:
            rank_files = [job.tmp / f"rng_rank{r}.pt" for r in range(acc.num_processes)]
            if not sync:
                async_save.wait_for_files(rank_files, timeout_s)
            for path in rank_files:  # other ranks fsynced their own file
                data = path.read_bytes()
                files[path.name] = fmt.file_entry(data)
                hashes = path.with_name(f".files_{path.stem.removeprefix('rng_')}.json")
                if job.own_files is not None:  # the main process gathers every rank's hashes
                    files.update(json.loads(hashes.read_text()))
                    hashes.unlink()
            for shard_dir in fmt.SUBDIRS:  # DCP (DeepSpeed) fsynced the files, not their folders
                if (job.tmp / shard_dir).is_dir():
                    fmt.fsync_dir(job.tmp / shard_dir)
            fmt.commit(job.tmp, job.final, job.manifest, files)
            folder.write_pointers(job.root, job.step, job.new_best)
    except OSError as err:
        failed = err
    if failed is not None:
        if acc.is_main_process:
            shutil.rmtree(job.tmp, ignore_errors=True)
        raise write_error(job, failed) from failed
    if acc.is_main_process and job.prune:
        best_step = job.best["step"] if job.best is not None else None
        folder.prune(job.root, job.step, keep_last, best_step)


def write_blobs(job: async_save.SaveJob) -> dict[str, dict[str, Any]]:
    """The main process's small files of a sharded checkpoint (the shards are
    written already); returns their manifest entries."""
    files = {}
    for fname, data in job.blobs.items():
        with fmt.HashingWriter(job.tmp / fname, fmt.threads("hash")) as out:
            out.write(data)
        files[fname] = out.entry
    return files


def write_error(job: async_save.SaveJob, failed: Exception) -> CheckpointError:
    """The error a failed save raises: the disk advice for the file system's
    errors only; anything else (tensors sharing memory, a layout the format
    cannot store) is named as it is."""
    if not isinstance(failed, OSError):
        return CheckpointError(
            f"could not write checkpoint {job.name} in {job.root}: {failed}. Earlier "
            "checkpoints are intact; this is not a disk problem: the state itself could "
            "not be written in this format (checkpoint.format, docs/checkpoints.md)."
        )
    return CheckpointError(
        f"could not write checkpoint {job.name} in {job.root}: {failed.strerror or failed} "
        f"({failed.filename or ''}). Earlier checkpoints are intact; free disk space or fix "
        "permissions, then restart the same command to resume."
    )
