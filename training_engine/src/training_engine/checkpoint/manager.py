"""Saving when policy.py says so, the commit protocol, and restoring the checkpoint
a ResumePlan chose (resume.py; docs/checkpoints.md).

Protocol: every rank writes into ``step_N.tmp/`` -> barrier -> the main process
fsyncs, writes MANIFEST.json, renames to ``step_N/``, fsyncs, replaces the
pointers, and only then prunes. The manager gets ``cfg.checkpoint``; the book
says what is a new best, the position is the state's, the stop decision is passed in.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType
from omegaconf import DictConfig
from safetensors.torch import save as save_safetensors

from ..config import ConfigError
from ..loaders import batches_per_epoch
from ..schema import values
from ..state import Position, TrainState, rng_state, set_rng_state
from . import base, elastic, folder, full_state, policy, resume, save, sharded, zero
from . import format as fmt
from .format import CheckpointError, ConfigMismatch
from .resume import ResumePlan

log = logging.getLogger(__name__)


class CheckpointManager:
    """Saves and resumes ``state`` (a TrainState) under ``<run_dir>/checkpoints``.

    ``checkpoint`` is ``cfg.checkpoint``; ``config`` the resolved config as plain
    data (saved as config.json, compared on resume); ``agreement`` (a StepAgreement)
    is asked before every save, so no checkpoint is written after a non-finite loss.
    """

    def __init__(
        self,
        *,
        checkpoint: DictConfig | dict[str, Any],
        config: dict[str, Any],
        run_dir: Path,
        accelerator: Any,
        state: TrainState,
        book: Any = None,
        agreement: Any = None,
        timeout_s: float = 1800.0,
        frozen: base.Base | None = None,
    ) -> None:
        # every key (a test may give a few), as plain values: the rules read them every step
        self.ck = values("checkpoint", checkpoint)
        self.config = config
        self.enabled = self.ck.enabled
        self.dir = Path(run_dir) / "checkpoints"
        self.accelerator = accelerator
        self.state = state
        self.batches_per_epoch = batches_per_epoch(state.train_loader)  # None: a stream
        if self.batches_per_epoch is None and self.ck.every_n_epochs:
            raise ConfigError(
                f"checkpoint.every_n_epochs={self.ck.every_n_epochs} is not allowed with a "
                "training set that has no length (a stream has no epoch end to save at): "
                "expected checkpoint.every_n_epochs=null and checkpoint.every_n_steps=N"
            )
        self.batch_size = elastic.per_process_batch(state.train_loader, accelerator.num_processes)
        # checkpoint.format: auto = sharded under FSDP (no rank gathers the state), else
        # full; DeepSpeed's optimizer is in its own files whatever the format (zero.py)
        self.layout = (
            ("sharded" if accelerator.is_fsdp2 else "full")
            if self.ck.format == "auto"
            else self.ck.format
        )
        if getattr(accelerator, "distributed_type", None) == DistributedType.DEEPSPEED:
            self.layout = "deepspeed"
        # checkpoint.weights: the trainable state alone when the model's frozen base
        # (``frozen``, fingerprinted once when built) is most of it (base.py)
        self.frozen = frozen
        trainable = frozen is not None and self.layout != "deepspeed"
        trainable = trainable and base.resolve(self.ck.weights, state.model) == base.TRAINABLE
        self.weights = base.TRAINABLE if trainable else base.FULL
        self.agreement = agreement
        self.book = book  # the MetricBook: which step was a new best of save_best.monitor
        if book is not None and self.enabled:
            policy.watch_best(self.ck, book)
        self.timeout_s = float(timeout_s)
        self.best: dict[str, Any] | None = None  # step, value of save_best.monitor
        self.resumed_from: str | None = None
        self.last_saved: Path | None = None
        self._last_saved_step: int | None = None
        self._pending_best: dict[str, Any] | None = None
        self._metrics: dict[str, float] = {}  # the latest metrics, for the manifest
        # checkpoint.async_save: stage in memory, write and commit in a background thread.
        self.asynchronous = self.ck.async_save
        self._stager = save.Stager()
        self._in_flight: save.SaveJob | None = None  # at most one save
        if self.enabled:
            if accelerator.is_main_process:
                for path in folder.remove_stale_tmp(self.dir):
                    log.warning(f"removed {path}: left by an interrupted save")
            accelerator.wait_for_everyone()

    @property
    def trainable_base(self) -> base.Base | None:
        """The frozen base, when this run saves the trainable weights only (the final
        model.safetensors too: save_final_weights); else None."""
        return self.frozen if self.weights == base.TRAINABLE else None

    # --- what preflight asks -----------------------------------------------------------

    def planned_saves(
        self, total: int, start: int, *, steps_per_epoch: int | None, evaluations: set[int]
    ) -> set[int]:
        """Steps in (start, total] that may save (policy.planned_saves)."""
        return policy.planned_saves(
            self.ck, total, start, steps_per_epoch=steps_per_epoch, evaluations=evaluations
        )

    def kept_on_disk(self) -> tuple[int, str]:
        """How many checkpoints can be on disk at once, and why (policy.kept_on_disk)."""
        return policy.kept_on_disk(self.ck)

    # --- resume ----------------------------------------------------------------------

    def restore(self, plan: ResumePlan) -> Position:
        """Restore every live object from the checkpoint ``plan`` chose (resume.py) and
        return where training continues; a fresh start: the start. Newer checkpoints
        than the resumed one are set aside (renamed, never deleted): one timeline."""
        if plan.checkpoint is None:
            return Position()
        ckpt = plan.checkpoint
        position = self._apply(ckpt, plan.manifest, plan.files)
        self.best = plan.trainer.get("best_checkpoint")
        self._last_saved_step = position.step
        self.resumed_from = str(ckpt)
        self.state.position = position
        self.accelerator.wait_for_everyone()  # every rank restored before anything moves
        if self.accelerator.is_main_process:
            for old, new in folder.set_aside_newer_than(self.dir, position.step):
                log.warning(f"{old.name} is newer than the resumed checkpoint: moved to {new}")
        log.info(
            f"resumed from {ckpt}: step {position.step}, epoch {position.epoch + 1}, "
            f"batch {position.batch} of {self.batches_per_epoch}"
        )
        return position

    def load(self, ckpt: Path) -> Position:
        """Verify and restore one checkpoint (preflight's round trip), changing
        nothing else; returns its position. Every file is verified and parsed and
        the config compared before a live object is touched."""
        manifest, files = resume.verify(
            ckpt, config=self.config, accelerator=self.accelerator, frozen=self.frozen
        )
        return self._apply(ckpt, manifest, files)

    def _apply(self, ckpt: Path, manifest: dict[str, Any], loaded: dict[str, Any]) -> Position:
        """Load verified, parsed files into the live objects. ConfigMismatch when the
        state does not fit them (another model or optimizer)."""
        world = self.accelerator.num_processes
        saved_world = int(manifest.get("world_size", 1))
        trainer = loaded[fmt.TRAINER_STATE]
        batch, problem = elastic.resume_batch(
            trainer,
            saved_world=saved_world,
            world=world,
            batch_size=self.batch_size,
            batches_per_epoch=self.batches_per_epoch,
        )
        if saved_world != world:
            log.warning(
                f"{ckpt} was saved with {saved_world} processes, resuming with {world}: "
                "the same epoch order continues from the same sample, but not bit-exactly"
                + (f"; {problem}" if problem else "")
            )
        rng_name = next(n for n in loaded if n.startswith(fmt.RNG_PREFIX))
        layout = manifest.get("layout", "full")
        try:
            trainable = manifest.get("weights") == base.TRAINABLE  # its base was checked
            full_state.restore(
                layout,
                ckpt,
                self.accelerator,
                self.state.model,
                self.state.optimizer,
                loaded,
                trainable,
            )
            self.state.scheduler.load_state_dict(loaded[fmt.SCHEDULER])
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None and fmt.SCALER in loaded:
                scaler.load_state_dict(loaded[fmt.SCALER])
            for name, obj in self.state.stateful.items():
                if name in trainer["stateful"]:
                    obj.load_state_dict(trainer["stateful"][name])
                elif f"{name}.safetensors" in loaded:  # an extra whose state is tensors
                    obj.load_state_dict(loaded[f"{name}.safetensors"])
                else:  # e.g. a callback added since that checkpoint
                    log.warning(f"{ckpt} holds no state of {name!r}: it starts afresh")
            if self.agreement is not None and "loss_guard" in trainer:
                self.agreement.guard.load_state_dict(trainer["loss_guard"])
            set_rng_state(loaded[rng_name])  # last: nothing after this draws numbers
        except (RuntimeError, KeyError, ValueError) as err:
            raise ConfigMismatch(f"{ckpt}: the state does not fit this run: {err}") from err
        # At the end of an epoch, batch == batches_per_epoch: train.py skips
        # the whole epoch (nothing left of it) and goes on with the next one.
        return Position(int(trainer["step"]), int(trainer["epoch"]), batch)

    # --- save ------------------------------------------------------------------------

    def maybe_save(self, *, metrics: dict, stop: bool) -> Path | None:
        """At every optimizer-step boundary: ``due``, then ``save_due`` when it is."""
        reasons = self.due(metrics=metrics, stop=stop)
        return self.save_due(reasons) if reasons else None

    def due(self, *, metrics: dict, stop: bool) -> list[str]:
        """At every optimizer-step boundary (the state's position): why a save is due
        (empty: none), by the rules (every N steps, at the end of every N epochs, on a
        new best value of ``save_best.monitor`` logged at this step (the book decides),
        after a stop signal: ``stop``, from ``StepAgreement.at_step``). ``metrics``:
        the latest value of every metric, for the manifest. Cheap, and no collective:
        the loop times and watches only an actual save (``save_due``)."""
        self._metrics = dict(metrics)
        if not self.enabled:
            return []
        if self._in_flight is not None and not self._in_flight.thread.is_alive():
            self.wait()  # done: a failure surfaces now rather than at the next save
        position = self.state.position
        self._pending_best = (
            policy.new_best(self.ck, position.step, self.book) if self.book else None
        )
        reasons = policy.save_reasons(
            self.ck,
            step=position.step,
            epoch=position.epoch,
            batch=position.batch,
            batches_per_epoch=self.batches_per_epoch,
            is_new_best=self._pending_best is not None,
            stop=stop,
        )
        return [] if self._last_saved_step == position.step else reasons

    def save_due(self, reasons: list[str]) -> Path:
        """The save ``due`` asked for, at the state's position (a collective)."""
        position = self.state.position
        return self.save(position.step, position.epoch, position.batch, reasons)

    def finish(self, *, metrics: dict, stop: bool) -> Path | None:
        """After the loop: the final save (``save_last``; after a stop signal,
        the stop checkpoint) and the save in flight committed on every rank,
        at the state's position. Returns the final save's folder (None: none made)."""
        step, epoch, batch = (
            self.state.position.step,
            self.state.position.epoch,
            self.state.position.batch,
        )
        self._metrics = dict(metrics)
        last = self.ck.save_last or stop
        saved = None
        if self.enabled and last and self._last_saved_step != step:
            saved = self.save(step, epoch, batch, ["signal" if stop else "last"])
        if self.enabled and self.asynchronous:
            self.wait()
            self.accelerator.wait_for_everyone()  # the main process has committed
        return saved

    def save(self, step: int, epoch: int, batch: int, reasons: list[str]) -> Path:
        """Write one checkpoint with the atomic protocol (module docstring).

        With ``checkpoint.async_save`` this returns once the state is staged (copied
        to CPU memory the training does not touch); a background thread writes
        and commits it with the same protocol. One save at most is in flight:
        the next ``save`` and ``finish`` wait for it first."""
        self.wait()
        if self.agreement is not None:  # never save the state after a non-finite loss
            self.agreement.at_step(step, saving=True)
        new_best = self._pending_best if "best" in reasons else None
        self._pending_best = None
        job = self._stage(step, epoch, batch, reasons, new_best, self.dir, self.asynchronous)
        failed = self._write_shards(job, save.make_tmp(job, self.accelerator))
        if new_best is not None:
            self.best = new_best
        self._last_saved_step = step
        if self.asynchronous:
            if failed is not None:  # no barrier follows: the other ranks write in background
                shutil.rmtree(job.tmp, ignore_errors=True)
                raise save.write_error(job, failed)
            self._in_flight = job
            save.start(
                job,
                lambda j: self._write(j, None, sync=False),
                announce=self.accelerator.is_main_process,
            )
            return job.final
        self._write(job, failed, sync=True)
        self.last_saved = job.final
        self.accelerator.wait_for_everyone()
        log.info(f"checkpoint saved: {job.final} ({', '.join(reasons)})")
        return job.final

    def scratch_save(self, directory: Path, step: int) -> Path:
        """A synchronous save of the current state into ``directory`` (preflight's
        round trip), with nothing of this run's checkpoints touched: no pruning,
        no best, no change to what ``maybe_save`` and ``finish`` decide."""
        job = self._stage(step, 0, 0, ["preflight"], None, Path(directory), False)
        job.prune = False
        failed = self._write_shards(job, save.make_tmp(job, self.accelerator))
        self._write(job, failed, sync=True)
        self.accelerator.wait_for_everyone()
        return job.final

    def wait(self) -> None:
        """Block until the save in flight (``checkpoint.async_save``) is written and,
        on the main process, committed; raise CheckpointError if it failed."""
        job, self._in_flight = self._in_flight, None
        if job is None:
            return
        error = save.join(job)
        if isinstance(error, CheckpointError):
            raise error
        if error is not None:
            raise CheckpointError(f"checkpoint {job.name} failed: {error!r}") from error
        self.last_saved = job.final

    def _stage(
        self,
        step: int,
        epoch: int,
        batch: int,
        reasons: list[str],
        new_best: dict | None,
        root: Path,
        asynchronous: bool,
    ) -> save.SaveJob:
        """Everything a checkpoint holds, taken now: tensors (main process:
        model, optimizer; copied when async) and small files as bytes. In the
        main thread on every rank: FSDP gathers the state here (collectives)."""
        acc = self.accelerator
        name = folder.checkpoint_name(step)
        best = new_best or self.best
        blobs = {fmt.rng_file(acc.process_index): save.torch_bytes(rng_state())}
        # full: gathered (collectives under FSDP); sharded: this rank's live shards
        trainable = self.weights == base.TRAINABLE
        tensors, shards, extra = full_state.take(
            self.layout, acc, self.state.model, self.state.optimizer, trainable
        )
        blobs.update(extra)
        if trainable and acc.is_main_process:  # the reference to what was not saved
            blobs[fmt.BASE] = self.frozen.to_bytes()
        # on every rank: an extra's state may be gathered (the log window's sums)
        extras = {n: obj.state_dict() for n, obj in self.state.stateful.items()}
        if acc.is_main_process:
            blobs.update(self._small_files(step, epoch, batch, best, extras))
        job = save.SaveJob(
            name=name,
            step=step,
            root=root,
            tmp=root / f"{name}.tmp",
            final=root / name,
            reasons=reasons,
            new_best=new_best,
            best=best,
            manifest={
                "format": fmt.FORMAT_VERSION,
                "hash": fmt.HASH,  # each file entry names its algorithm too
                "step": step,
                "epoch": epoch,
                "batch": batch,
                "reasons": reasons,
                "metrics": dict(self._metrics),
                "best": best,
                "world_size": acc.num_processes,
                "grad_accum_steps": acc.gradient_accumulation_steps,
                "layout": self.layout,
                "weights": self.weights,  # full | trainable (base.json: the frozen rest)
                "seed": self.config.get("seed"),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "versions": fmt.versions(),
            },
            tensors=tensors,
            blobs=blobs,
            shards=shards,
        )
        if asynchronous:  # training goes on and changes the live tensors
            job.tensors, job.copied = self._stager.copy(tensors)
        return job

    def _small_files(
        self, step: int, epoch: int, batch: int, best: dict[str, Any] | None, extras: dict
    ) -> dict[str, bytes | memoryview]:
        # Stateful extras: JSON-able dicts go into trainer_state.json, dicts of
        # tensors (e.g. EMA weights) into <name>.safetensors.
        tensor_extras = {
            n: s for n, s in extras.items() if s and all(torch.is_tensor(v) for v in s.values())
        }
        trainer_state = {
            "step": step,
            "epoch": epoch,
            "batch": batch,
            "batches_per_epoch": self.batches_per_epoch,
            # the position on any world size (elastic.resume_batch)
            "samples_in_epoch": batch * self.accelerator.num_processes * self.batch_size,
            "best_checkpoint": best,
            "stateful": {n: s for n, s in extras.items() if n not in tensor_extras},
            # W&B and MLflow run ids (tracking.py): a resume continues those runs.
            "tracker_run_ids": {
                t.name: t.run_id for t in self.accelerator.trackers if getattr(t, "run_id", None)
            },
        }
        if self.agreement is not None:
            trainer_state["loss_guard"] = self.agreement.guard.state_dict()
        blobs = {fmt.SCHEDULER: save.torch_bytes(self.state.scheduler.state_dict())}
        for name, tensors in tensor_extras.items():
            blobs[f"{name}.safetensors"] = save_safetensors(save.unshared(tensors))
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            blobs[fmt.SCALER] = save.torch_bytes(scaler.state_dict())
        blobs[fmt.TRAINER_STATE] = (json.dumps(trainer_state, indent=2) + "\n").encode()
        blobs[fmt.CONFIG] = (json.dumps(self.config, indent=2) + "\n").encode()
        return blobs

    def _write_shards(self, job: save.SaveJob, failed: OSError | None) -> OSError | None:
        """Sharded and DeepSpeed: every rank writes its shards (DeepSpeed's files) now
        (main thread, collectives; with ``checkpoint.async_save`` too: the background does
        hashing and commit)."""
        rank = self.accelerator.process_index
        if self.layout == "deepspeed":
            return zero.write_job(job, failed, self.state.model, rank)
        return sharded.write_job(job, failed, rank)

    def _write(self, job: save.SaveJob, failed: OSError | None, sync: bool) -> None:
        keep_last = self.ck.keep_last
        save.write_and_commit(job, self.accelerator, failed, sync, self.timeout_s, keep_last)
