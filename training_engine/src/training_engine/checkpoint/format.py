"""One checkpoint on disk, read: the table of its file names, the manifest,
verification and safe loading (each file read once; checksums in checksums.py).
Writing it is save.py's. No accelerator: unit-testable.

``step_0000500/`` holds ``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``
(``scaler.pt``), ``rng_rank{r}.pt``, ``trainer_state.json``, ``config.json`` and,
written last, ``MANIFEST.json`` (checksum and size of every file, checksums.py); a
sharded one (sharded.py) has ``model/`` and ``optimizer/`` shards instead; a DeepSpeed
one (zero.py) DeepSpeed's own files in ``deepspeed/`` instead of ``optimizer.pt``.
Nothing is unpickled beyond ``torch.load(weights_only=True)`` (DeepSpeed's files:
with zero.py's allowlist of three of its types). docs/checkpoints.md.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import platform
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file as load_safetensors_file

from .. import trust
from . import checksums

# Re-exported: callers name them as format's (fmt.HASH, fmt.file_entry, fmt.sha256).
from .checksums import (  # noqa: F401
    HASH,
    HASHES,
    HashingWriter,
    digest,
    entry_hash,
    file_entry,
    path_entry,
    sha256,
)

# The file names of a checkpoint and of its folder: every module names them from here.
MANIFEST = "MANIFEST.json"
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
SCALER = "scaler.pt"
TRAINER_STATE = "trainer_state.json"
CONFIG = "config.json"
OPTIMIZER_GROUPS = "optimizer_groups.json"  # sharded: the parameter groups, as JSON
RNG_PREFIX = "rng_rank"
BASE = "base.json"  # trainable weights only: the frozen base they stand on (base.py)
LATEST, BEST = "latest.json", "best.json"  # the pointers, beside the step_* folders
# The layout of a checkpoint folder: raised when a release writes what an older engine
# could not read (CHANGELOG.md names the migration). Every engine reads every format up
# to its own; the release that wrote a checkpoint is in its manifest's versions.
FORMAT_VERSION = 1  # unchanged by the hash: each entry names its algorithm


def rng_file(rank: int) -> str:
    """Each rank's RNG state: ``rng_rank{rank}.pt``."""
    return f"{RNG_PREFIX}{rank}.pt"


REQUIRED_FILES = (MODEL, OPTIMIZER, SCHEDULER, rng_file(0), TRAINER_STATE, CONFIG)
# checkpoint.format=sharded (sharded.py): model/ and optimizer/ hold per-rank shards.
SHARDED_REQUIRED_FILES = (OPTIMIZER_GROUPS, SCHEDULER, rng_file(0), TRAINER_STATE, CONFIG)
SHARD_DIRS = ("model", "optimizer")
# parallel=deepspeed (zero.py): DeepSpeed's own files (engine.save_checkpoint) in deepspeed/.
DEEPSPEED_DIR = "deepspeed"
DEEPSPEED_REQUIRED_FILES = (
    "model.safetensors",  # gathered: what eval.py, predict.py and export read
    "scheduler.pt",
    "rng_rank0.pt",
    "trainer_state.json",
    "config.json",
)
SUBDIRS = (*SHARD_DIRS, DEEPSPEED_DIR)  # the only folders a checkpoint may hold
LAYOUTS = ("full", "sharded", "deepspeed")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or no valid one could be loaded."""

    exit_code = 1


class ConfigMismatch(CheckpointError):
    """The checkpoint belongs to a run with an incompatible config (no fallback)."""


# --- files: fsync, hashing, names ----------------------------------------------------


def bad_name(name: str) -> bool:
    """A manifest name that is not a plain file of the checkpoint (or of one of
    its shard folders): refused, so nothing outside the checkpoint is read."""
    parts = name.split("/")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] not in SUBDIRS):
        return True
    return any(not part or part.startswith(".") for part in parts)


def listing(ckpt: Path) -> list[str]:
    """Every entry of a checkpoint by manifest name (shard folders included), symlinks
    listed, never followed: a symlinked shard folder is one (bad) entry."""
    names = []
    for p in ckpt.iterdir():
        if p.name in SUBDIRS and trust.real_dir(p):
            names += [f"{p.name}/{q.name}" for q in p.iterdir()]
        else:
            names.append(p.name)
    return names


def versions() -> dict[str, str]:
    import accelerate
    import safetensors

    from ..version import __version__

    return {
        "training_engine": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }


# --- reading and verifying -------------------------------------------------------------


def read_manifest(ckpt: Path) -> dict[str, Any]:
    """MANIFEST.json of ``ckpt``, read bounded and checked against what a manifest
    holds (``check_manifest``); CheckpointError (corrupt) otherwise."""
    if not trust.real_dir(ckpt):
        raise CheckpointError(f"{ckpt}: not a checkpoint folder (missing, or a symlink)")
    path = ckpt / MANIFEST
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: missing (an incomplete checkpoint)")
    try:
        manifest = check_manifest(trust.read_json(path))
    except (trust.Malformed, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: not a valid manifest ({err})") from err
    layout = manifest.get("layout", "full")
    required = {"sharded": SHARDED_REQUIRED_FILES, "deepspeed": DEEPSPEED_REQUIRED_FILES}
    files = manifest["files"]
    missing = [name for name in required.get(layout, REQUIRED_FILES) if name not in files]
    if layout == "sharded" and not any(name.startswith("model/") for name in files):
        missing.append("model/ shard")
    if layout == "deepspeed" and not any(name.startswith(f"{DEEPSPEED_DIR}/") for name in files):
        missing.append(f"{DEEPSPEED_DIR}/ file")
    if manifest.get("weights") == "trainable" and BASE not in files:
        missing.append(BASE)  # trainable weights only: the base they stand on (base.py)
    if missing:
        raise CheckpointError(f"{path}: lists no {', '.join(missing)}")
    return manifest


def check_format(ckpt: Path, manifest: dict[str, Any]) -> None:
    """ConfigError (exit 2, before any work) for a checkpoint of a format newer than
    this engine reads: a later release wrote it. Naming both releases, and the way on."""
    from ..config import ConfigError
    from ..version import __version__

    written = manifest.get("format", 1)
    if _is_count(written) and written <= FORMAT_VERSION:
        return
    versions = manifest.get("versions")
    theirs = versions.get("training_engine") if isinstance(versions, dict) else None
    raise ConfigError(
        f"{ckpt} is in checkpoint format {written!r}, written by training-engine "
        f"{theirs or 'unknown'}; this engine, training-engine {__version__}, reads formats "
        f"up to {FORMAT_VERSION}. Resume it with training-engine {theirs or 'of that run'} "
        "or newer (the pin in pyproject.toml); the engine's CHANGELOG.md names each "
        "format's migration"
    )


def check_manifest(manifest: Any) -> dict[str, Any]:
    """What the rest of the code reads from a manifest, checked (ValueError otherwise):
    every file entry a plain name with a size and one known checksum, and the
    position and world as integers."""
    _require(isinstance(manifest, dict), "not an object")
    files = manifest["files"]
    _require(isinstance(files, dict), "files is not an object")
    for name, entry in files.items():
        _require(not bad_name(name), f"bad file name {name!r}")
        _require(isinstance(entry, dict) and _is_count(entry.get("size")), f"{name}: no size")
        entry_hash(entry)
    for key in ("step", "epoch", "batch"):
        _require(_is_count(manifest.get(key, 0)), f"{key} is not an integer in [0, 2**53)")
    for key in ("world_size", "grad_accum_steps"):
        _require(_is_count(manifest.get(key, 1)) and manifest.get(key, 1) >= 1, f"bad {key}")
    _require(manifest.get("layout", "full") in LAYOUTS, "unknown layout")
    _require(manifest.get("weights", "full") in ("full", "trainable"), "unknown weights")
    _require(isinstance(manifest.get("metrics", {}), dict), "metrics is not an object")
    return manifest


def check_trainer_state(state: Any) -> dict[str, Any]:
    """trainer_state.json: the position as integers, the extras' states as objects."""
    _require(isinstance(state, dict), "not an object")
    for key in ("step", "epoch", "batch"):
        _require(_is_count(state.get(key)), f"{key} is not an integer in [0, 2**53)")
    for key in ("batches_per_epoch", "samples_in_epoch"):
        _require(state.get(key) is None or _is_count(state[key]), f"{key} is not an integer")
    _require(isinstance(state.get("stateful", {}), dict), "stateful is not an object")
    _require(
        all(isinstance(v, dict) for v in state.get("stateful", {}).values()),
        "a stateful extra's state is not an object",
    )
    ids = state.get("tracker_run_ids") or {}
    _require(isinstance(ids, dict) and all(isinstance(v, str) for v in ids.values()), "run ids")
    best = state.get("best_checkpoint")
    _require(best is None or (isinstance(best, dict) and _is_count(best.get("step"))), "best")
    return state


def check_object(value: Any) -> dict[str, Any]:
    _require(isinstance(value, dict), "not an object")
    return value


def check_base(value: Any) -> dict[str, Any]:
    """base.json: a checksum, and per frozen tensor an entry with its checksum."""
    _require(isinstance(value, dict) and isinstance(value.get("checksum"), str), "no checksum")
    tensors = value.get("tensors")
    _require(isinstance(tensors, dict) and bool(tensors), "no tensors")
    _require(all(isinstance(t, dict) and isinstance(t.get(HASH), str) for t in tensors.values()),
             "a tensor without its checksum")  # fmt: skip
    return value


# What each JSON file of a checkpoint must hold (checked when parsed).
JSON_CHECKS: dict[str, Callable[[Any], Any]] = {
    "trainer_state.json": check_trainer_state,
    "config.json": check_object,
    "optimizer_groups.json": check_object,
    BASE: check_base,
}


def _require(ok: bool, problem: str) -> None:
    if not ok:
        raise ValueError(problem)


MAX_COUNT = 2**53  # a step, size or position past this is no run's (and no float's)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT


def _size_checked(ckpt: Path, name: str, expected: dict[str, Any]) -> Path:
    path = ckpt / name
    if bad_name(name):
        raise CheckpointError(f"{ckpt / MANIFEST}: bad file name {name!r}")
    try:
        size = trust.regular_file(path).stat().st_size
    except trust.Malformed as err:
        raise CheckpointError(str(err)) from err
    if size != expected["size"]:
        raise CheckpointError(
            f"{path}: {size} bytes, the manifest says {expected['size']} (truncated?)"
        )
    return path


def _check_file(ckpt: Path, name: str, expected: dict[str, Any]) -> None:
    """Size and checksum of one file against its manifest entry, hashed from
    a read-only memory map: the page cache's own bytes, no copy (the parsing
    maps the same pages: each file's bytes are read from the disk once)."""
    path = _size_checked(ckpt, name, expected)
    hasher = HASHES[entry_hash(expected)[0]]()
    try:
        with open(path, "rb") as f:
            if expected["size"]:  # an empty file cannot be mapped
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    view = memoryview(mapped)
                    try:
                        hasher.update(view)  # releases the GIL: runs beside the parsing
                    finally:
                        view.release()
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot be read ({err})") from err
    algorithm, want = entry_hash(expected)
    if hasher.hexdigest() != want:
        raise CheckpointError(f"{path}: {algorithm} does not match the manifest (corrupted)")


def verify_files(
    ckpt: Path,
    names: Iterable[str] | None = None,
    parse: Callable[[str, Path], Any] | None = None,
    expected: Any = None,
) -> dict[str, Any]:
    """Check the size and checksum of a checkpoint's files (all, or ``names``)
    against its manifest, and meanwhile parse them with ``parse`` (hashed in
    threads beside the parsing, from memory maps of the same pages the parsing
    reads, so verification costs little extra time), judging what they hold
    (judge.py: before anything is hashed, the model file's header against
    ``expected``, the reader's model (a judge.ModelSpec) if it has one, and every
    file's size; after parsing, the position, RNG and optimizer states). Raise
    CheckpointError naming the first bad file; nothing parsed is returned unless
    every file is intact and holds what it can."""
    from . import judge  # it reads this module's names

    manifest = read_manifest(ckpt)
    files = manifest["files"]
    extra = sorted(n for n in listing(ckpt) if n != MANIFEST and n not in files)
    if extra:
        raise CheckpointError(f"{ckpt}: files not in the manifest: {', '.join(extra)}")
    wanted = list(files) if names is None else [n for n in names if n in files]
    # every one a regular file of its size before any is opened, and so the top-level
    # files the judge opens whichever are wanted (a truncated one named as truncated)
    judged = [n for n in files if "/" not in n]
    for name in dict.fromkeys([*wanted, *judged]):
        _size_checked(ckpt, name, files[name])
    judge.before_reading(ckpt, manifest, expected)  # headers and sizes: nothing large read
    parsed: dict[str, Any] = {}
    parse_error: CheckpointError | None = None
    checks = [checksums.threads("hash").submit(_check_file, ckpt, n, files[n]) for n in wanted]
    for name in wanted if parse else []:
        try:
            parsed[name] = parse(name, ckpt / name)
        except CheckpointError as err:
            parse_error = err
            break
    for check in checks:
        check.result()  # a hash problem explains a parse error: report it first
    if parse_error is not None:
        raise parse_error
    judge.after_parsing(ckpt, manifest, parsed, expected)  # what the files hold, together
    return parsed


def verify_checkpoint(ckpt: Path, expected: Any = None) -> str | None:
    """None when valid, else the reason (naming the file): every file's size and
    checksum, and what every reader checks of its content (``check_content``,
    judge.py; ``expected``: the model it must fit, a judge.ModelSpec, if known)."""
    try:
        verify_files(ckpt, parse=check_content, expected=expected)
    except CheckpointError as err:
        return str(err)
    return None


def check_content(name: str, path: Path) -> Any:
    """What makes a checkpoint valid beyond its checksums, the same for every reader
    (resume, eval, load_model, the CLI): its JSON files parse and hold what they
    must (JSON_CHECKS), its safetensors headers parse, its own torch files load
    weights-only (memory-mapped, not copied); returned, for judge.after_parsing.
    DeepSpeed's files (deepspeed/) are checked when a resume loads them (zero.py)."""
    if name.endswith(".json"):
        return parse_file(name, path)
    if name.endswith(".safetensors"):
        check_safetensors_header(path)
    if name.endswith(".pt") and "/" not in name:
        return load_tensors_safely(path, str(path), owned=False)
    return None


def check_safetensors_header(path: Path) -> None:
    """The header parses (JSON; no tensor is read). Anything else in its place (a
    pickle, a header claiming more bytes than the file has) is refused here."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: refused: not a safetensors file ({err})") from err


def load_tensors_safely(source: Path | bytes, name: str, owned: bool = True) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only. A
    pickle that would build any other object (e.g. run code) is refused, and so is
    a file with a compressed record (judge.stored_records: it would inflate past its
    size). A path is memory-mapped and (``owned``) its tensors copied out once
    (``_owned``): the bytes come from the page cache the hashing thread reads."""
    from .judge import stored_records

    stored_records(source, name)
    try:
        if isinstance(source, bytes | bytearray):
            return torch.load(io.BytesIO(source), map_location="cpu", weights_only=True)
        loaded = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
        return _owned(loaded) if owned else loaded
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        raise CheckpointError(
            f"{name}: refused: it holds more than tensors and plain containers, so it is "
            f"not loaded (weights_only=True): {first_line}"
        ) from err


def _owned(tree: Any) -> Any:
    """``tree`` with every tensor moved from the file's memory map into memory
    of its own, one copy per storage (views stay views of one storage), so
    nothing keeps the file mapped: a pruned checkpoint frees its disk space,
    and the optimizer never writes into copy-on-write pages."""
    copies: dict[int, torch.UntypedStorage] = {}

    def own(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        storage = value.untyped_storage()
        key = storage.data_ptr()
        if key not in copies:
            copies[key] = storage.clone()
        out = torch.empty(0, dtype=value.dtype)
        return out.set_(copies[key], value.storage_offset(), value.size(), value.stride())

    def walk(value: Any) -> Any:  # the containers torch.load(weights_only=True) builds
        if isinstance(value, dict):
            return type(value)((k, walk(v)) for k, v in value.items())
        if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
            return type(value)(walk(v) for v in value)
        return own(value)

    return walk(tree)


def parse_file(name: str, path: Path) -> Any:
    """A checkpoint file as Python data: safetensors, weights-only torch, JSON."""
    if name.endswith(".safetensors"):
        check_safetensors_header(path)  # the same refusal as every other reader's
    try:
        if name.endswith(".safetensors"):
            return load_safetensors_file(path)  # memory-mapped; load_state_dict copies
        if name.endswith(".json"):
            return JSON_CHECKS.get(Path(name).name, lambda data: data)(trust.read_json(path))
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: unreadable ({err})") from err
    return load_tensors_safely(path, str(path))
