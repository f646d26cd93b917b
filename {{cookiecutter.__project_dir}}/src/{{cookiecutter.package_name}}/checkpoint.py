"""Checkpoints: atomic, verified, safe to load, and a resume that continues bit-exactly.

Layout (``<run dir>/checkpoints/``)::

    step_0000500/            one complete checkpoint, never modified after commit
      model.safetensors      weights of the unwrapped model (safetensors: no pickle)
      optimizer.pt           optimizer state     } torch.save of tensors and plain
      scheduler.pt           scheduler state     } containers only, loaded with
      scaler.pt              grad scaler (fp16)  } torch.load(weights_only=True)
      rng_rank{r}.pt         python/numpy/torch/CUDA RNG state of rank r
      trainer_state.json     step, epoch, batch within the epoch, best metric,
                             metric book, skipped NaN steps, tracker run ids
      config.json            the resolved config of the run
      MANIFEST.json          written last: step, epoch, metrics, world size,
                             versions, seed, sha256 and size of every file
    latest.json, best.json   pointers, replaced atomically (os.replace)

Save protocol: every rank writes into ``step_0000500.tmp/`` -> barrier -> the main
process fsyncs, writes MANIFEST.json, fsyncs, renames the folder to
``step_0000500/``, fsyncs ``checkpoints/``, replaces the pointers, and only then
prunes to ``keep_last`` (>= 2) plus the best one. A crash at any moment leaves
the previous checkpoints untouched and at most a ``*.tmp`` folder, which is
ignored and removed at the next start. A disk error (full, read-only) removes
the half-written ``*.tmp`` and stops the run with a message naming the folder.

Cost: files are serialized straight to disk in threads and hashed from the
same buffers as they are written (no second pass, no extra copy); torch.save's
own per-record CRC32 is off (the sha256 covers every byte); deleting pruned
checkpoints does not block. ``python bench.py --only checkpoint`` compares a
save and a load with plain ``torch.save``/``torch.load``.

Async (``checkpoint.async=true``): ``save`` copies the state into CPU buffers
(reused between saves; page-locked, without waiting, from a GPU) and returns;
a background thread writes the files and, on the main process, commits with
the same protocol. The collectives (FSDP's state gathering, the barrier after
the folder is made) stay in the main thread; the writer threads use none: each
rank writes its ``rng_rank{r}.pt`` under a hidden name and renames it when
complete, and the main process commits once every rank's file is there. At
most one save is in flight: the next save and the end of the run wait for it
(a stop signal too: the stop checkpoint is saved after it). A SIGKILL
mid-write leaves a ``*.tmp`` folder, as above.

Why not ``accelerator.save_state``: it writes straight into the final folder (a
crash leaves a half-written checkpoint that looks complete), with
``total_limit`` it deletes the oldest checkpoint *before* writing the new one,
it keeps no checksums, and its RNG file is a pickle that needs
``weights_only=False``. The model and optimizer state still come from
accelerate (``get_state_dict``, ``unwrap_model``) and the partial epoch is
skipped with its ``skip_first_batches``.

Loading ignores ``*.tmp`` and folders without a valid manifest, verifies every
sha256, and on any problem warns naming the file and falls back to the previous
checkpoint. Nothing is unpickled beyond tensors and plain containers
(``weights_only=True``), so a file holding a pickle that would run code is
refused even when its manifest hash matches.

Signals (``checkpoint.save_on_signal``): SIGTERM, SIGUSR1, SIGUSR2 and Ctrl-C
(SIGINT) set a flag; at the next optimizer-step boundary the run saves a
checkpoint and exits with ``128 + signal number``: **143** after SIGTERM, **138**
after SIGUSR1, **140** after SIGUSR2, **130** after Ctrl-C (the codes a shell
reports for a process killed by that signal, so schedulers treat the job as
interrupted; the checkpoint is complete and restarting the same command
resumes). Further signals do not interrupt the save; a second Ctrl-C stops at
once (a save in flight is left as ``*.tmp``, which the atomic protocol ignores).
If a Python handler was installed for the signal before ours (submitit's
preemption handler in a SLURM job: SIGUSR2 by default), it runs once the
checkpoint is saved, so submitit requeues the job and the requeued job resumes
from that checkpoint.

Command line::

    python -m {{ cookiecutter.package_name }}.checkpoint list   RUN_DIR|CHECKPOINTS_DIR|CHECKPOINT
    python -m {{ cookiecutter.package_name }}.checkpoint verify PATH      # exit 1 if any is invalid
    python -m {{ cookiecutter.package_name }}.checkpoint export PATH [-o model.safetensors]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import hashlib
import io
import json
import logging
import os
import pickle
import platform
import random
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file as load_safetensors_file
from safetensors.torch import save as save_safetensors

from .config_checks import ALLOWED_CONFIG_CHANGES, config_differences
from .run_dir import write_json_atomic

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step_(\d+)$")
REQUIRED_FILES = (
    "model.safetensors",
    "optimizer.pt",
    "scheduler.pt",
    "rng_rank0.pt",
    "trainer_state.json",
    "config.json",
)
EXIT_SIGNAL = {signal.SIGTERM: 143, signal.SIGUSR1: 138, signal.SIGUSR2: 140, signal.SIGINT: 130}
# Test hook, documented and inert unless set: ``CKPT_TEST_PAUSE_AT=POINT[@STEP]``
# makes a save pause (sleep) at POINT (between_files, before_rename,
# before_pointers, pruning) so a test can SIGKILL the process exactly there;
# ``POINT[@STEP]+SECONDS`` pauses that long, then the save goes on.
_PAUSE_ENV = "CKPT_TEST_PAUSE_AT"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or no valid one could be loaded."""

    exit_code = 1


class TrainingInterrupted(RuntimeError):
    """A stop signal arrived; a checkpoint was saved. ``exit_code`` = 128 + signum."""

    def __init__(self, signum: int, path: Path | None) -> None:
        self.exit_code = EXIT_SIGNAL.get(signum, 128 + signum)
        name = signal.Signals(signum).name
        where = f"checkpoint saved at {path}" if path else "checkpoints disabled: nothing saved"
        super().__init__(f"{name} received: stopped at a step boundary, {where}")


@dataclass
class Position:
    """Where training continues: optimizer steps done, epoch, and micro-batches
    of that epoch already trained (0: none yet; all of them: the epoch is done)."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


# --- files: fsync, hashing, reading and verifying ------------------------------------


@functools.cache
def _threads(kind: str) -> ThreadPoolExecutor:
    """Long-lived worker threads, one pool per ``kind`` ("io": writing files,
    "hash": hashing; separate, so writers can wait for hashes without a
    deadlock). Starting threads for every save would cost more than hashing."""
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"checkpoint-{kind}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes | memoryview) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()  # releases the GIL: runs beside writes


def _step_of(path: Path) -> int | None:
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def committed_checkpoints(root: Path) -> list[Path]:
    """``step_*`` folders in ``root`` (no ``*.tmp``), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None]
    return sorted(found, key=_step_of)


def read_manifest(ckpt: Path) -> dict[str, Any]:
    path = ckpt / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (an incomplete checkpoint)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        assert isinstance(files, dict) and all(
            isinstance(v["sha256"], str) and isinstance(v["size"], int) for v in files.values()
        )
        int(manifest["step"])
    except (ValueError, KeyError, TypeError, AssertionError) as err:
        raise CheckpointError(f"{path}: not a valid manifest ({err!r})") from err
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
        raise CheckpointError(f"{path}: lists no {', '.join(missing)}")
    return manifest


def _check_file(ckpt: Path, name: str, expected: dict[str, Any]) -> None:
    """Size and sha256 of one file against its manifest entry."""
    path = ckpt / name
    if "/" in name or name.startswith("."):
        raise CheckpointError(f"{ckpt / MANIFEST}: bad file name {name!r}")
    try:
        size = path.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(
                f"{path}: {size} bytes, the manifest says {expected['size']} (truncated?)"
            )
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)  # releases the GIL: runs beside the parsing
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror})") from err
    if digest.hexdigest() != expected["sha256"]:
        raise CheckpointError(f"{path}: sha256 does not match the manifest (corrupted)")


def verify_files(
    ckpt: Path,
    names: Iterable[str] | None = None,
    parse: Callable[[str, Path], Any] | None = None,
) -> dict[str, Any]:
    """Check the size and sha256 of a checkpoint's files (all, or ``names``)
    against its manifest, and meanwhile parse them with ``parse`` (the hashes
    are computed in threads beside the parsing, so verification costs little
    extra time). Raise CheckpointError naming the first bad file; nothing
    parsed is returned unless every file is intact."""
    manifest = read_manifest(ckpt)
    files = manifest["files"]
    extra = sorted(p.name for p in ckpt.iterdir() if p.name != MANIFEST and p.name not in files)
    if extra:
        raise CheckpointError(f"{ckpt}: files not in the manifest: {', '.join(extra)}")
    wanted = list(files) if names is None else [n for n in names if n in files]
    parsed: dict[str, Any] = {}
    parse_error: CheckpointError | None = None
    checks = [_threads("hash").submit(_check_file, ckpt, n, files[n]) for n in wanted]
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
    return parsed


def verify_checkpoint(ckpt: Path) -> str | None:
    """None when valid, else the reason (naming the file)."""
    try:
        verify_files(ckpt)
    except CheckpointError as err:
        return str(err)
    return None


def load_tensors_safely(source: Path | bytes, name: str) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only. A
    pickle that would build any other object (e.g. run code) is refused."""
    try:
        if isinstance(source, bytes | bytearray):
            source = io.BytesIO(source)
        return torch.load(source, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        raise CheckpointError(
            f"{name}: refused: it holds more than tensors and plain containers, so it is "
            f"not loaded (weights_only=True): {first_line}"
        ) from err


def parse_file(name: str, path: Path) -> Any:
    """A checkpoint file as Python data: safetensors, weights-only torch, JSON."""
    try:
        if name.endswith(".safetensors"):
            return load_safetensors_file(path)
        if name.endswith(".json"):
            return json.loads(path.read_text(encoding="utf-8"))
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: unreadable ({err})") from err
    return load_tensors_safely(path, str(path))


def _pause_point(point: str, step: int) -> None:
    wanted = os.environ.get(_PAUSE_ENV)
    if not wanted:
        return
    where, _, seconds = wanted.partition("+")
    name, _, at = where.partition("@")
    if name == point and (not at or int(at) == step):
        print(f"CKPT_TEST_PAUSED {point} step {step}", file=sys.stderr, flush=True)
        time.sleep(float(seconds or 3600))


# --- RNG state as tensors and plain containers (so weights_only loading works) -------


def rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {
            "version": version,
            "state": torch.tensor(mt, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _versions() -> dict[str, str]:
    import accelerate
    import safetensors

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }


# --- the manager ------------------------------------------------------------------------


class CheckpointManager:
    """Saves and resumes the training state (see the module docstring).

    ``stateful`` maps names to objects with ``state_dict()``/``load_state_dict()``
    returning JSON-able dicts (e.g. the MetricBook); they are saved in
    ``trainer_state.json``. ``guard`` (a LossGuard) is checked before every save
    so that no checkpoint is written after a non-finite loss.
    """

    def __init__(
        self,
        cfg: Any,
        run_dir: Path,
        accelerator: Any,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        train_loader: Any,
        stateful: dict[str, Any] | None = None,
        guard: Any = None,
    ) -> None:
        from omegaconf import OmegaConf

        self.config = OmegaConf.to_container(cfg, resolve=True)
        self.ck = self.config.get("checkpoint", {})
        self.enabled = bool(self.ck.get("enabled", False))
        self.dir = Path(run_dir) / "checkpoints"
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.batches_per_epoch = len(train_loader)
        self.stateful = stateful or {}
        self.guard = guard
        self.best: dict[str, Any] | None = None  # step, value of save_best.monitor
        self.resumed_from: str | None = None
        self.last_saved: Path | None = None
        self._last_saved_step: int | None = None
        self._signal: int | None = None
        self._old_handlers: dict[int, Any] = {}
        self._pending_best: dict[str, Any] | None = None
        self._position = Position()  # of the last step boundary seen
        self._stop_checked_at: int | None = None  # step of the last stop all-reduce
        self._stop_seen = False
        # checkpoint.async: stage in memory, write and commit in a background thread.
        self.asynchronous = bool(self.ck.get("async", False))
        self._stager = _Stager()
        self._in_flight: _SaveJob | None = None  # at most one save
        if self.enabled:
            if accelerator.is_main_process:
                self._remove_stale_tmp()
            accelerator.wait_for_everyone()
            if self.ck.get("save_on_signal", True):
                self._install_signal_handlers()

    # --- signals ---------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        for signum in EXIT_SIGNAL:
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._signal is None:
            self._signal = signum  # acted on at the next step boundary
        elif signum == signal.SIGINT:  # a second Ctrl-C: stop now, without saving
            signal.default_int_handler(signum, frame)

    def _hand_signal_on(self) -> None:
        """Now that the checkpoint is saved, run the handler that was there
        before ours, if it is Python code: under submitit it requeues the job
        (on rank 0; other ranks only log) or, out of requeues, fails it."""
        handler = self._old_handlers.get(self._signal)
        if callable(handler) and handler is not signal.default_int_handler:
            log.info(f"passing {signal.Signals(self._signal).name} on to {handler.__qualname__}")
            handler(self._signal, None)

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers = {}

    @property
    def stop_requested(self) -> bool:
        """True once a stop signal arrived (on any rank)."""
        if self.accelerator.num_processes == 1:
            return self._signal is not None
        # One all-reduce per step boundary, however often the loop asks: every
        # rank asks in the same order, so the cache keeps the collectives matched.
        step = self._position.step
        if self._stop_checked_at != step:
            flag = torch.tensor(
                [0 if self._signal is None else self._signal], device=self.accelerator.device
            )
            flag = self.accelerator.reduce(flag, "max")  # a signal may reach one rank only
            if int(flag) and self._signal is None:
                self._signal = int(flag)
            self._stop_checked_at, self._stop_seen = step, bool(int(flag))
        return self._stop_seen

    # --- resume ----------------------------------------------------------------------

    def resume(self) -> Position:
        """Restore the newest valid checkpoint that ``checkpoint.resume`` points to.

        ``auto``: this run dir's checkpoints, or a fresh start when there are none.
        ``never``: a fresh start. A path (run dir, checkpoints dir or one
        checkpoint): resume from there, or fail when nothing there is valid.
        Once this run dir has checkpoints of its own, a path outside it only
        started the run: restarting the same command continues from this run's
        own checkpoints (a path inside it, e.g. an older checkpoint, is honored).
        """
        if not self.enabled:
            return Position()
        mode = str(self.ck.get("resume", "auto"))
        if mode not in ("auto", "never") and committed_checkpoints(self.dir):
            target = Path(mode).resolve()
            if not target.is_relative_to(self.dir.parent.resolve()):
                log.info(
                    f"{self.dir} has checkpoints: continuing this run from them "
                    f"(checkpoint.resume={mode} started it)"
                )
                mode = "auto"
        if mode == "never":
            existing = committed_checkpoints(self.dir)
            if existing:
                raise CheckpointError(
                    f"checkpoint.resume=never, but {self.dir} already holds checkpoints "
                    f"({existing[-1].name}, ...) of an earlier run; saving beside them would "
                    "mix two runs. Use another run_name, move them away, or resume=auto"
                )
            log.info("checkpoint.resume=never: starting from scratch")
            return Position()
        if mode == "auto":
            candidates = committed_checkpoints(self.dir)
            if not candidates:
                log.info(f"no checkpoint in {self.dir}: starting from scratch")
                return Position()
            where = f"checkpoint.resume=auto found {len(candidates)} in {self.dir}"
        else:
            candidates = self._candidates(Path(mode))
            where = f"checkpoint.resume={mode}"
        problems = []
        for ckpt in reversed(candidates):  # newest first
            try:
                position = self.load(ckpt)
            except ConfigMismatch:
                raise
            except CheckpointError as err:
                log.warning(f"skipping checkpoint {ckpt}: {err}")
                problems.append(str(err))
                continue
            self.resumed_from = str(ckpt)
            self._position = position
            self.accelerator.wait_for_everyone()  # every rank chose before anything moves
            if self.accelerator.is_main_process:
                self._set_aside_newer_than(position.step)
            log.info(
                f"resumed from {ckpt}: step {position.step}, epoch {position.epoch + 1}, "
                f"batch {position.batch} of {self.batches_per_epoch}"
            )
            return position
        detail = "\n  ".join(problems) or "no checkpoint folders there"
        raise CheckpointError(
            f"{where}: no valid checkpoint, so nothing to resume (not starting over "
            f"silently):\n  {detail}"
        )

    @staticmethod
    def _candidates(path: Path) -> list[Path]:
        if not path.exists():
            raise CheckpointError(f"checkpoint.resume={path}: no such file or directory")
        if path.name.endswith(".tmp"):
            raise CheckpointError(f"checkpoint.resume={path}: an unfinished save, not a checkpoint")
        if _step_of(path) is not None or (path / MANIFEST).exists():
            return [path]  # exactly this checkpoint
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        return committed_checkpoints(root)

    def load(self, ckpt: Path) -> Position:
        """Restore one checkpoint; return where training continues.

        Every file is verified and parsed first and the config compared; the
        live objects are touched only after that, so a bad checkpoint (raises
        CheckpointError) changes nothing. ConfigMismatch: it belongs to another
        kind of run, which no fallback can fix."""
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        manifest = read_manifest(ckpt)
        saved_world = int(manifest.get("world_size", 1))
        rng_name = f"rng_rank{rank % saved_world}.pt"
        names = [n for n in manifest["files"] if not n.startswith("rng_rank")] + [rng_name]
        loaded = verify_files(ckpt, names, parse=parse_file)
        saved_config = loaded["config.json"]
        diffs = config_differences(saved_config, self.config)
        if diffs:
            # Not a fallback case: every checkpoint of that run has the same config.
            raise ConfigMismatch(
                f"cannot resume from {ckpt}: the config differs in keys that change the "
                "model, data or optimization:\n  " + "\n  ".join(diffs) + "\n"
                "Start a new run (another run_name, or checkpoint.resume=never), or put "
                "the keys back. Allowed to change: " + ", ".join(ALLOWED_CONFIG_CHANGES)
            )
        if saved_world != world:
            log.warning(
                f"{ckpt} was saved with {saved_world} processes, resuming with {world}: "
                "the run continues, but not bit-exactly"
            )
        trainer = loaded["trainer_state.json"]
        try:
            self._load_model_and_optimizer(loaded["model.safetensors"], loaded["optimizer.pt"])
            self.scheduler.load_state_dict(loaded["scheduler.pt"])
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None and "scaler.pt" in loaded:
                scaler.load_state_dict(loaded["scaler.pt"])
            for name, obj in self.stateful.items():
                if name in trainer["stateful"]:
                    obj.load_state_dict(trainer["stateful"][name])
            if self.guard is not None and "loss_guard" in trainer:
                self.guard.load_state_dict(trainer["loss_guard"])
            set_rng_state(loaded[rng_name])  # last: nothing after this draws numbers
        except (RuntimeError, KeyError, ValueError) as err:
            raise ConfigMismatch(f"{ckpt}: the state does not fit this run: {err}") from err
        self.best = trainer.get("best_checkpoint")
        self._last_saved_step = int(trainer["step"])
        # At the end of an epoch, batch == batches_per_epoch: train.py skips
        # the whole epoch (nothing left of it) and goes on with the next one.
        return Position(int(trainer["step"]), int(trainer["epoch"]), int(trainer["batch"]))

    # Under FSDP a checkpoint holds the full (gathered) model and optimizer state,
    # not DCP shards: DCP's metadata file is a pickle, which safe loading refuses
    # to unpickle. Full state also loads into any world size and exports as is.
    def _optimizer_state(self) -> dict[str, Any]:
        """The optimizer state as plain tensors; a collective under FSDP."""
        if not self.accelerator.is_fsdp2:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(
            self._plain_model(), self.optimizer.optimizer, options=options
        )

    def _load_model_and_optimizer(self, model_state: dict, optimizer_state: dict) -> None:
        if not self.accelerator.is_fsdp2:
            self._plain_model().load_state_dict(model_state)
            self.optimizer.load_state_dict(optimizer_state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)  # every rank shards its copy
        set_model_state_dict(self._plain_model(), model_state, options=options)
        set_optimizer_state_dict(
            self._plain_model(), self.optimizer.optimizer, optimizer_state, options=options
        )

    def _plain_model(self) -> torch.nn.Module:
        """The model without DDP's and torch.compile's wrappers: the parameter
        names its class defines, with or without ``trainer.compile``."""
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)

    def _set_aside_newer_than(self, step: int) -> None:
        """Checkpoints newer than the one resumed from (corrupted, or from an
        abandoned continuation) are renamed, not deleted, so that ``auto`` and
        pruning never mix the two timelines."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for ckpt in committed_checkpoints(self.dir):
            if _step_of(ckpt) > step:
                target = ckpt.with_name(f"{ckpt.name}.superseded-{stamp}")
                os.replace(ckpt, target)
                log.warning(f"{ckpt.name} is newer than the resumed checkpoint: moved to {target}")

    # --- save ------------------------------------------------------------------------

    def maybe_save(self, step: int, epoch: int, batch: int) -> Path | None:
        """At every optimizer-step boundary: save when a rule says so (every N
        steps, at the end of every N epochs, on a new best value of the monitored
        metric, after a stop signal)."""
        self._position = Position(step, epoch, batch)
        if not self.enabled:
            return None
        if self._in_flight is not None and not self._in_flight.thread.is_alive():
            self.wait()  # done: a failure surfaces now rather than at the next save
        reasons = []
        every_steps, every_epochs = self.ck.get("every_n_steps"), self.ck.get("every_n_epochs")
        if every_steps and step % every_steps == 0:
            reasons.append("every_n_steps")
        if every_epochs and batch == self.batches_per_epoch and (epoch + 1) % every_epochs == 0:
            reasons.append("every_n_epochs")
        if self._is_new_best(step):
            reasons.append("best")
        if self.ck.get("save_on_signal", True) and self.stop_requested:
            reasons.append("signal")
        if not reasons or self._last_saved_step == step:
            return None
        return self.save(step, epoch, batch, reasons)

    def finish(self) -> None:
        """After the loop: the final save (``save_last``), or, after a stop
        signal, raise TrainingInterrupted (the checkpoint is already saved).
        The position saved is the last one passed to ``maybe_save``."""
        step, epoch, batch = self._position.step, self._position.epoch, self._position.batch
        try:
            if self._signal is not None:
                if self.enabled and self._last_saved_step != step:
                    self.save(step, epoch, batch, ["signal"])
                self._finish_async_save()
                self._hand_signal_on()
                raise TrainingInterrupted(self._signal, self.last_saved)
            if self.enabled and self.ck.get("save_last", True) and self._last_saved_step != step:
                self.save(step, epoch, batch, ["last"])
            self._finish_async_save()
        finally:
            self._restore_signal_handlers()

    def _finish_async_save(self) -> None:
        """Before the run ends: the save in flight is committed on every rank."""
        if self.enabled and self.asynchronous:
            self.wait()
            self.accelerator.wait_for_everyone()  # the main process has committed

    def _is_new_best(self, step: int) -> bool:
        best_cfg = self.ck.get("save_best") or {}
        if not best_cfg.get("enabled", False):
            return False
        book = self.stateful.get("metrics")
        monitor = best_cfg.get("monitor")
        if book is None or book.last_step.get(monitor) != step:
            return False
        value = book.last[monitor]
        if value != value:  # NaN never improves
            return False
        if self.best is not None:
            better = (
                value > self.best["value"]
                if best_cfg["mode"] == "max"
                else value < self.best["value"]
            )
            if not better:
                return False
        self._pending_best = {"step": step, "monitor": monitor, "value": value}
        return True

    def save(self, step: int, epoch: int, batch: int, reasons: list[str]) -> Path:
        """Write one checkpoint with the atomic protocol (module docstring).

        With ``checkpoint.async`` this returns once the state is staged (copied
        to CPU memory the training does not touch); a background thread writes
        and commits it with the same protocol. One save at most is in flight:
        the next ``save`` and ``finish`` wait for it first."""
        self.wait()
        if self.guard is not None:
            self.guard.check(step)  # never save the state after a non-finite loss
        acc = self.accelerator
        new_best = self._pending_best if "best" in reasons else None
        self._pending_best = None
        # In the main thread on every rank: the collectives (FSDP gathers the
        # state), staging, and the barrier once the folder exists.
        job = self._stage(step, epoch, batch, reasons, new_best)
        failed: OSError | None = None
        try:
            if acc.is_main_process:
                self.dir.mkdir(parents=True, exist_ok=True)
                if job.tmp.exists():
                    shutil.rmtree(job.tmp)
                job.tmp.mkdir()
        except OSError as err:
            failed = err
        acc.wait_for_everyone()
        if new_best is not None:
            self.best = new_best
        self._last_saved_step = step
        if self.asynchronous:
            if failed is not None:  # no barrier follows: the other ranks write in background
                shutil.rmtree(job.tmp, ignore_errors=True)
                raise _write_error(job.name, self.dir, failed)
            job.thread = threading.Thread(
                target=self._write_in_background, args=(job,), name=f"checkpoint-{job.name}"
            )
            self._in_flight = job
            job.thread.start()
            return job.final
        self._write_and_commit(job, failed, sync=True)
        self.last_saved = job.final
        acc.wait_for_everyone()
        log.info(f"checkpoint saved: {job.final} ({', '.join(reasons)})")
        return job.final

    def wait(self) -> None:
        """Block until the save in flight (``checkpoint.async``) is written and,
        on the main process, committed; raise CheckpointError if it failed."""
        job, self._in_flight = self._in_flight, None
        if job is None:
            return
        job.thread.join()
        if isinstance(job.error, CheckpointError):
            raise job.error
        if job.error is not None:
            raise CheckpointError(f"checkpoint {job.name} failed: {job.error!r}") from job.error
        self.last_saved = job.final

    def _stage(
        self, step: int, epoch: int, batch: int, reasons: list[str], new_best: dict | None
    ) -> _SaveJob:
        """Everything a checkpoint holds, taken now: tensors (main process:
        model, optimizer; copied when async) and small files as bytes."""
        acc = self.accelerator
        name = f"step_{step:07d}"
        best = new_best or self.best
        model_state = acc.get_state_dict(self._plain_model())  # collectives under FSDP
        optimizer_state = self._optimizer_state()
        blobs = {f"rng_rank{acc.process_index}.pt": _torch_bytes(rng_state())}
        tensors: dict[str, Any] = {}
        if acc.is_main_process:
            tensors = {"model.safetensors": model_state, "optimizer.pt": optimizer_state}
            blobs.update(self._small_files(step, epoch, batch, best))
        job = _SaveJob(
            name=name,
            step=step,
            tmp=self.dir / f"{name}.tmp",
            final=self.dir / name,
            reasons=reasons,
            new_best=new_best,
            best=best,
            manifest={
                "format": FORMAT_VERSION,
                "step": step,
                "epoch": epoch,
                "batch": batch,
                "reasons": reasons,
                "metrics": dict(getattr(self.stateful.get("metrics"), "last", {})),
                "best": best,
                "world_size": acc.num_processes,
                "seed": self.config.get("seed"),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "versions": _versions(),
            },
            tensors=tensors,
            blobs=blobs,
        )
        if self.asynchronous:  # training goes on and changes the live tensors
            job.tensors, job.copied = self._stager.copy(tensors)
        return job

    def _small_files(
        self, step: int, epoch: int, batch: int, best: dict[str, Any] | None
    ) -> dict[str, bytes | memoryview]:
        trainer_state = {
            "step": step,
            "epoch": epoch,
            "batch": batch,
            "batches_per_epoch": self.batches_per_epoch,
            "best_checkpoint": best,
            "stateful": {n: obj.state_dict() for n, obj in self.stateful.items()},
            # W&B and MLflow run ids (tracking.py): a resume continues those runs.
            "tracker_run_ids": {
                t.name: t.run_id for t in self.accelerator.trackers if getattr(t, "run_id", None)
            },
        }
        if self.guard is not None:
            trainer_state["loss_guard"] = self.guard.state_dict()
        blobs = {"scheduler.pt": _torch_bytes(self.scheduler.state_dict())}
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            blobs["scaler.pt"] = _torch_bytes(scaler.state_dict())
        blobs["trainer_state.json"] = (json.dumps(trainer_state, indent=2) + "\n").encode()
        blobs["config.json"] = (json.dumps(self.config, indent=2) + "\n").encode()
        return blobs

    def _write_in_background(self, job: _SaveJob) -> None:
        try:
            self._write_and_commit(job, None, sync=False)
        except BaseException as err:  # handed to the main thread by wait()
            job.error = err
            log.error(f"checkpoint {job.name} failed in the background: {err}")
            return
        if self.accelerator.is_main_process:
            log.info(f"checkpoint saved: {job.final} ({', '.join(job.reasons)}; async)")

    def _write_and_commit(self, job: _SaveJob, failed: OSError | None, sync: bool) -> None:
        """Every rank writes its files into ``job.tmp``; then the main process
        writes the manifest, commits (rename), replaces the pointers and prunes.

        ``sync``: barriers between the two phases (main thread). Otherwise (a
        background thread) no collectives at all: the main process waits for
        each rank's file to appear (written under a hidden name, fsynced, then
        renamed into place)."""
        acc = self.accelerator
        files: dict[str, dict[str, Any]] = {}
        try:
            if failed is None:
                if job.copied is not None:
                    job.copied.synchronize()  # the staging copies from the GPU have landed
                rng_name = f"rng_rank{acc.process_index}.pt"
                hidden = job.tmp / f".{rng_name}.part"
                _write_file(hidden, job.blobs.pop(rng_name))
                os.replace(hidden, job.tmp / rng_name)
                if acc.is_main_process:
                    files = self._write_main_files(job)
        except OSError as err:
            failed = err
        if sync:
            acc.wait_for_everyone()
        try:
            if acc.is_main_process and failed is None:
                rank_files = [job.tmp / f"rng_rank{r}.pt" for r in range(acc.num_processes)]
                if not sync:
                    self._wait_for_files(rank_files)
                for path in rank_files:  # other ranks fsynced their own file
                    data = path.read_bytes()
                    files[path.name] = {"sha256": _sha256(data), "size": len(data)}
                manifest = {**job.manifest, "files": dict(sorted(files.items()))}
                _write_file(job.tmp / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
                _fsync_dir(job.tmp)
                _pause_point("before_rename", job.step)
                if job.final.exists():  # the same step again (e.g. after a fallback)
                    old = job.final.with_name(f"{job.name}.replaced.tmp")
                    os.replace(job.final, old)
                    os.replace(job.tmp, job.final)
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.replace(job.tmp, job.final)  # the commit
                _fsync_dir(self.dir)
                _pause_point("before_pointers", job.step)
                pointer = {"step": job.step, "path": job.name}
                write_json_atomic(self.dir / "latest.json", pointer)
                if job.new_best is not None:
                    write_json_atomic(self.dir / "best.json", {**pointer, **job.new_best})
                _fsync_dir(self.dir)
        except OSError as err:
            failed = err
        if failed is not None:
            if acc.is_main_process:
                shutil.rmtree(job.tmp, ignore_errors=True)
            raise _write_error(job.name, self.dir, failed) from failed
        if acc.is_main_process:
            self._prune(job.step, job.best)

    def _wait_for_files(self, paths: list[Path]) -> None:
        """Async saves under several processes: until every rank's file exists."""
        timeout = float((self.config.get("parallel") or {}).get("timeout_s") or 1800)
        deadline = time.monotonic() + timeout
        while not all(p.exists() for p in paths):
            if not threading.main_thread().is_alive():  # the run failed: nothing to wait for
                raise TimeoutError(f"the run ended before every rank wrote {paths[0].parent}")
            if time.monotonic() > deadline:
                missing = ", ".join(p.name for p in paths if not p.exists())
                raise TimeoutError(f"after {timeout:.0f} s still missing: {missing}")
            time.sleep(0.01)

    def _write_main_files(self, job: _SaveJob) -> dict[str, dict[str, Any]]:
        """Serialize and write + fsync every main-process file, in threads. Each
        file is hashed from the same buffers as they are written (hashlib and
        file writes release the GIL), so hashing costs little time and no copy."""
        model_state, optimizer_state = job.tensors["model.safetensors"], job.tensors["optimizer.pt"]
        writers = _threads("io")

        def write(fname: str, serialize: Callable[[_HashingWriter], Any]) -> dict[str, Any]:
            with _HashingWriter(job.tmp / fname, _threads("hash")) as out:
                serialize(out)
            return out.entry

        futures = {
            "model.safetensors": writers.submit(
                write,
                "model.safetensors",
                lambda out: out.write(
                    save_safetensors(_unshared(model_state), metadata={"step": str(job.step)})
                ),
            )
        }
        _pause_point("between_files", job.step)  # the model file written or in flight
        futures["optimizer.pt"] = writers.submit(
            write, "optimizer.pt", lambda out: _torch_save(optimizer_state, out)
        )
        for fname, data in job.blobs.items():
            futures[fname] = writers.submit(write, fname, lambda out, d=data: out.write(d))
        return {fname: future.result() for fname, future in futures.items()}

    # --- housekeeping (main process) ----------------------------------------------------

    def _remove_stale_tmp(self) -> None:
        if not self.dir.is_dir():
            return
        for path in self.dir.glob("*.tmp"):
            log.warning(f"removing {path}: left by an interrupted save")
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        for path in self.dir.glob(".*.tmp"):
            path.unlink(missing_ok=True)

    def _prune(self, step: int, best: dict[str, Any] | None) -> None:
        """Keep the ``keep_last`` newest plus the best; runs only after a commit."""
        keep_last = max(2, int(self.ck.get("keep_last", 3)))
        ckpts = committed_checkpoints(self.dir)
        keep = {p.name for p in ckpts[-keep_last:]}
        if best is not None:
            keep.add(f"step_{best['step']:07d}")
        for ckpt in ckpts[:-1]:  # never the newest
            if ckpt.name not in keep:
                # Rename first (atomic), then delete: a crash mid-delete leaves a
                # *.tmp folder (removed at the next start), never a half checkpoint.
                doomed = ckpt.with_name(f"{ckpt.name}.pruned.tmp")
                os.replace(ckpt, doomed)
                _pause_point("pruning", step)
                # Deleting large files takes a while; nothing waits for it.
                _threads("io").submit(shutil.rmtree, doomed, ignore_errors=True)


class ConfigMismatch(CheckpointError):
    """The checkpoint belongs to a run with an incompatible config (no fallback)."""


def _write_error(name: str, root: Path, failed: OSError) -> CheckpointError:
    return CheckpointError(
        f"could not write checkpoint {name} in {root}: {failed.strerror or failed} "
        f"({failed.filename or ''}). Earlier checkpoints are intact; free disk space or fix "
        "permissions, then restart the same command to resume."
    )


@dataclass
class _SaveJob:
    """One checkpoint on its way to disk: what it holds, staged, and (async)
    the thread writing it."""

    name: str
    step: int
    tmp: Path
    final: Path
    reasons: list[str]
    new_best: dict[str, Any] | None
    best: dict[str, Any] | None
    manifest: dict[str, Any]  # all but "files"
    tensors: dict[str, Any]  # file name -> state holding tensors (main process)
    blobs: dict[str, bytes | memoryview]  # file name -> serialized small file
    copied: Any = None  # a CUDA event: the staging copies have landed
    thread: threading.Thread | None = None
    error: BaseException | None = None


class _Stager:
    """Copies a state (nested dicts/lists of tensors) into CPU buffers that the
    training never touches, reusing the buffers of the previous save (no new
    allocations, no page faults). From a GPU: into page-locked memory, without
    waiting (the returned CUDA event says when the copies have landed)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def copy(self, tree: Any) -> tuple[Any, Any]:
        on_gpu = []
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


class _HashingWriter:
    """A file being written that hashes what passes through it, from the same
    buffers: large ones are hashed in ``hashers`` while this thread writes them
    (hashlib and file writes release the GIL), so hashing adds little time. On
    exit (no error) the file is fsynced; ``entry`` is its manifest entry."""

    def __init__(self, path: Path, hashers: ThreadPoolExecutor) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 (closed by __exit__)
        self._digest = hashlib.sha256()
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

    def __enter__(self) -> _HashingWriter:
        return self

    def __exit__(self, error_type: Any, *_: Any) -> None:
        try:
            if error_type is None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self.entry = {"sha256": self._digest.hexdigest(), "size": self._size}
        finally:
            self._file.close()


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def _torch_save(obj: Any, out: Any) -> None:
    """torch.save without its per-record CRC32: the manifest's sha256 already
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


def _torch_bytes(obj: Any) -> memoryview:
    buf = io.BytesIO()
    _torch_save(obj, buf)
    return buf.getbuffer()


# --- command line -------------------------------------------------------------------------


def _resolve_many(path: Path) -> list[Path]:
    if _step_of(path) is not None or (path / MANIFEST).exists():
        return [path]
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    return committed_checkpoints(root)


def _cli_list(path: Path) -> int:
    ckpts = _resolve_many(path)
    if not ckpts:
        print(f"no checkpoints in {path}")
        return 1
    print(f"{'checkpoint':<16} {'step':>8} {'epoch':>6} {'size MB':>8}  status  metrics")
    for ckpt in ckpts:
        problem = verify_checkpoint(ckpt)
        size = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file()) / 2**20
        try:
            manifest = read_manifest(ckpt)
            step, epoch = manifest["step"], manifest["epoch"] + 1
            metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(manifest["metrics"].items()))
        except CheckpointError:
            step, epoch, metrics = "?", "?", ""
        status = "valid" if problem is None else "INVALID"
        print(f"{ckpt.name:<16} {step:>8} {epoch:>6} {size:>8.2f}  {status:<7} {metrics}")
        if problem:
            print(f"    {problem}")
    return 0


def _cli_verify(path: Path) -> int:
    ckpts = _resolve_many(path)
    if not ckpts:
        print(f"no checkpoints in {path}")
        return 1
    bad = 0
    for ckpt in ckpts:
        problem = verify_checkpoint(ckpt)
        bad += problem is not None
        print(
            f"{'OK' if problem is None else 'INVALID':<8} {ckpt}"
            + (f"\n    {problem}" if problem else "")
        )
    print(f"{len(ckpts) - bad} valid, {bad} invalid")
    return 1 if bad else 0


def _cli_export(path: Path, out: Path) -> int:
    for ckpt in reversed(_resolve_many(path)):  # the newest valid one
        try:
            verify_files(ckpt, ["model.safetensors"], parse=parse_file)
        except CheckpointError as err:
            print(f"skipping {ckpt}: {err}", file=sys.stderr)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.copyfile(ckpt / "model.safetensors", tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
        print(f"exported {ckpt / 'model.safetensors'} -> {out}")
        return 0
    print(f"no valid checkpoint in {path}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}.checkpoint", description="Inspect checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command, text in [
        ("list", "step, epoch, size, validity and metrics of each checkpoint"),
        ("verify", "check every file's size and sha256 (exit 1 if any checkpoint is invalid)"),
        ("export", "write the newest valid checkpoint's weights as one model.safetensors"),
    ]:
        p = sub.add_parser(command, help=text)
        p.add_argument("path", type=Path, help="a run dir, its checkpoints/ or one checkpoint")
        if command == "export":
            p.add_argument("-o", "--output", type=Path, default=Path("model.safetensors"))
    args = parser.parse_args(argv)
    if args.command == "list":
        return _cli_list(args.path)
    if args.command == "verify":
        return _cli_verify(args.path)
    return _cli_export(args.path, args.output)


if __name__ == "__main__":
    sys.exit(main())
