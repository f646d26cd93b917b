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
# Config keys that may differ between a checkpoint and the run resuming it: run
# length, cadence of logs/evals/checkpoints, trackers, loader workers (the data
# order does not depend on them). Any other difference (model, data, optimizer,
# schedule, seed, precision, ...) is refused. Edit this tuple to allow more.
ALLOWED_CONFIG_CHANGES = (
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.log_every_n_steps",
    "trainer.eval_every_n_steps",
    "trainer.on_nan",
    "tracker",
    "checkpoint",
    "run_name",
    "project",
    "preflight",
    "data.num_workers",
    "data.pin_memory",
    "data.val_batch_size",
)
# Test hook, documented and inert unless set: ``CKPT_TEST_PAUSE_AT=POINT[@STEP]``
# makes a save pause (sleep) at POINT (between_files, before_rename,
# before_pointers, pruning) so a test can SIGKILL the process exactly there.
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
    with ThreadPoolExecutor(max_workers=4) as pool:
        checks = [pool.submit(_check_file, ckpt, n, files[n]) for n in wanted]
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
    name, _, at = wanted.partition("@")
    if name == point and (not at or int(at) == step):
        print(f"CKPT_TEST_PAUSED {point} step {step}", file=sys.stderr, flush=True)
        time.sleep(3600)


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


# --- config compatibility ---------------------------------------------------------------


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): tree}


def config_differences(saved: dict, current: dict) -> list[str]:
    """``key: old -> new`` for every difference outside ALLOWED_CONFIG_CHANGES."""
    old, new = _flatten(saved), _flatten(current)
    diffs = []
    for key in sorted(set(old) | set(new)):
        if old.get(key, "<absent>") == new.get(key, "<absent>"):
            continue
        if any(key == a or key.startswith(a + ".") for a in ALLOWED_CONFIG_CHANGES):
            continue
        diffs.append(f"{key}: {old.get(key, '<absent>')!r} -> {new.get(key, '<absent>')!r}")
    return diffs


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
        return get_optimizer_state_dict(self.model, self.optimizer.optimizer, options=options)

    def _load_model_and_optimizer(self, model_state: dict, optimizer_state: dict) -> None:
        if not self.accelerator.is_fsdp2:
            self.accelerator.unwrap_model(self.model).load_state_dict(model_state)
            self.optimizer.load_state_dict(optimizer_state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)  # every rank shards its copy
        set_model_state_dict(self.model, model_state, options=options)
        set_optimizer_state_dict(
            self.model, self.optimizer.optimizer, optimizer_state, options=options
        )

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
                self._hand_signal_on()
                raise TrainingInterrupted(self._signal, self.last_saved)
            if self.enabled and self.ck.get("save_last", True) and self._last_saved_step != step:
                self.save(step, epoch, batch, ["last"])
        finally:
            self._restore_signal_handlers()

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
        """Write one checkpoint with the atomic protocol (module docstring)."""
        if self.guard is not None:
            self.guard.check(step)  # never save the state after a non-finite loss
        acc = self.accelerator
        name = f"step_{step:07d}"
        tmp, final = self.dir / f"{name}.tmp", self.dir / name
        new_best = self._pending_best if "best" in reasons else None
        self._pending_best = None
        best = new_best or self.best
        # Everything every rank must compute (collectives under FSDP/DeepSpeed).
        model_state = acc.get_state_dict(self.model)
        optimizer_state = self._optimizer_state()
        failed: OSError | None = None
        try:
            if acc.is_main_process:
                self.dir.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
        except OSError as err:
            failed = err
        acc.wait_for_everyone()
        files: dict[str, dict[str, Any]] = {}
        try:
            if failed is None:
                _write_file(tmp / f"rng_rank{acc.process_index}.pt", _torch_bytes(rng_state()))
                if acc.is_main_process:
                    files = self._write_main_files(
                        tmp, step, epoch, batch, model_state, optimizer_state, best
                    )
        except OSError as err:
            failed = err
        acc.wait_for_everyone()
        try:
            if acc.is_main_process and failed is None:
                for r in range(acc.num_processes):  # other ranks fsynced their own file
                    data = (tmp / f"rng_rank{r}.pt").read_bytes()
                    files[f"rng_rank{r}.pt"] = {"sha256": _sha256(data), "size": len(data)}
                manifest = {
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
                    "files": dict(sorted(files.items())),
                }
                _write_file(tmp / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
                _fsync_dir(tmp)
                _pause_point("before_rename", step)
                if final.exists():  # the same step again (e.g. after a fallback)
                    old = final.with_name(f"{name}.replaced.tmp")
                    os.replace(final, old)
                    os.replace(tmp, final)
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.replace(tmp, final)  # the commit
                _fsync_dir(self.dir)
                _pause_point("before_pointers", step)
                pointer = {"step": step, "path": name}
                write_json_atomic(self.dir / "latest.json", pointer)
                if new_best is not None:
                    write_json_atomic(self.dir / "best.json", {**pointer, **new_best})
                _fsync_dir(self.dir)
        except OSError as err:
            failed = err
        if failed is not None:
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"could not write checkpoint {name} in {self.dir}: {failed.strerror or failed} "
                f"({failed.filename or ''}). Earlier checkpoints are intact; free disk space "
                "or fix permissions, then restart the same command to resume."
            ) from failed
        if new_best is not None:
            self.best = new_best
        self.last_saved, self._last_saved_step = final, step
        if acc.is_main_process:
            self._prune()
        acc.wait_for_everyone()
        log.info(f"checkpoint saved: {final} ({', '.join(reasons)})")
        return final

    def _write_main_files(
        self,
        tmp: Path,
        step: int,
        epoch: int,
        batch: int,
        model_state: dict[str, torch.Tensor],
        optimizer_state: dict[str, Any],
        best: dict[str, Any] | None,
    ) -> dict[str, dict[str, Any]]:
        """Serialize in memory, then write + fsync and hash each file in threads
        (hashlib and file writes release the GIL, so hashing costs little time)."""
        files: dict[str, dict[str, Any]] = {}
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
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = {}

            def submit(fname: str, data: bytes | memoryview) -> None:
                futures[fname] = (
                    pool.submit(_write_file, tmp / fname, data),
                    pool.submit(_sha256, data),
                    len(data),
                )

            tensors = _unshared(model_state)
            submit("model.safetensors", save_safetensors(tensors, metadata={"step": str(step)}))
            _pause_point("between_files", step)  # the model file written or in flight
            submit("optimizer.pt", _torch_bytes(optimizer_state))
            submit("scheduler.pt", _torch_bytes(self.scheduler.state_dict()))
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                submit("scaler.pt", _torch_bytes(scaler.state_dict()))
            submit("trainer_state.json", (json.dumps(trainer_state, indent=2) + "\n").encode())
            submit("config.json", (json.dumps(self.config, indent=2) + "\n").encode())
            for fname, (written, digest, size) in futures.items():
                written.result()
                files[fname] = {"sha256": digest.result(), "size": size}
        return files

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

    def _prune(self) -> None:
        """Keep the ``keep_last`` newest plus the best; runs only after a commit."""
        keep_last = max(2, int(self.ck.get("keep_last", 3)))
        ckpts = committed_checkpoints(self.dir)
        keep = {p.name for p in ckpts[-keep_last:]}
        if self.best is not None:
            keep.add(f"step_{self.best['step']:07d}")
        for ckpt in ckpts[:-1]:  # never the newest
            if ckpt.name not in keep:
                # Rename first (atomic), then delete: a crash mid-delete leaves a
                # *.tmp folder (removed at the next start), never a half checkpoint.
                doomed = ckpt.with_name(f"{ckpt.name}.pruned.tmp")
                os.replace(ckpt, doomed)
                _pause_point("pruning", self._last_saved_step)
                shutil.rmtree(doomed, ignore_errors=True)


class ConfigMismatch(CheckpointError):
    """The checkpoint belongs to a run with an incompatible config (no fallback)."""


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


def _torch_bytes(obj: Any) -> memoryview:
    buf = io.BytesIO()
    torch.save(obj, buf)
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
