"""The run around the task's step: what a project's ``train.py`` loops over.

``Trainer(cfg, run_dir)`` builds everything a run needs on this rank (accelerator,
seeds, task, data, model, optimizers, schedule, resume plan, checkpoints, trackers,
callbacks, preflight); ``batches()`` yields the batches of the run in order (a resumed
run continues mid-epoch) and ends when the run does; ``after_update()`` is everything
an optimizer step is followed by (logs, the ranks' agreement, evaluation, checkpoints,
callbacks); ``finish()`` writes the last checkpoint, the final weights and the summary.
The step itself (``task.training_step``) stays in ``train.py``, where its reader is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from . import moments
from .accel import (
    build_accelerator,
    built_whole,
    tell_deepspeed_the_micro_batch,
    weights_fingerprint,
)
from .adapters import base_node, describe_parameters
from .agreement import StepAgreement
from .callbacks import Callbacks, RunContext, build_callbacks, stateful
from .checkpoint import CheckpointManager, plain_model, plan_resume, save_final_weights
from .claim import Decision, agree, commit_attempt
from .classes import check_model_fits_classes, data_classes, write_classes
from .config import instantiate, instantiate_partial
from .debug import Debug
from .early_stopping import EarlyStopping
from .ema import WeightAverage
from .finetune import fine_tune
from .fits import check_model_fits_data
from .frozen import build_frozen_models
from .fsdp import shard_model
from .inference import BUILT_FROM_RUN
from .loaders import batches_per_epoch, continue_epoch, run_length
from .logs import setup_rank_logging
from .media import Media
from .metrics import MetricBook, WindowMeans
from .nonfinite import LossGuard, NonFiniteLoss
from .optimizers import build_optimizers
from .per_sample import exact_loaders
from .preemption import StopSignals
from .preflight import run_preflight
from .progress import Progress, RunClock
from .pruning import TrialReporter
from .recovery import note_recovery
from .run_dir import check_shared_storage, end_not_written, write_summary
from .schedules import ScheduleSteps
from .seeding import same_on_every_rank, seed_everything
from .state import TrainState
from .step import Step
from .summary import report_finished, run_summary
from .task import build_task
from .throughput import Throughput
from .tracking import finish_trackers, log_final_model, start_trackers, watch_model
from .trust import warn_what_evaluation_will_refuse
from .watchdog import Watchdog

log = logging.getLogger("train")
# What the loop logs itself, besides the task's own train/<log>s; the task's ``metrics``
# are its evaluation's (trainer.monitor picks one).
TRAIN_METRICS = ("train/loss", "train/lr", "train/grad_norm", "train/epoch")


class Trainer:
    """One process's run (every rank builds one; see launch.py). ``done``: nothing to
    train (a finished run, or preflight.only=true), and ``result`` is the answer."""

    def __init__(self, cfg: DictConfig, run_dir: Path, decision: Decision | None = None) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.done, self.result = False, None
        # --- logging, accelerator, seeds ---------------------------------------------
        accelerator = self.accelerator = build_accelerator(cfg, run_dir)
        # Every rank takes the main process's decision about the run dir (a collective:
        # a process launched with other values than the main one's stops them all here).
        decision = agree(decision, cfg=cfg, run_dir=run_dir, accelerator=accelerator)
        if decision.finished:  # some other launcher's process had to be told
            setup_rank_logging(run_dir, files=False)
            accelerator.end_training()
            self.done, self.result = True, report_finished(run_dir, decision.summary)
            return
        # Every rank sees the dir the main process writes (a collective: after it, the
        # main process has claimed the dir, so the other ranks may write there too).
        check_shared_storage(run_dir, accelerator)
        setup_rank_logging(run_dir)
        seed_everything(cfg.seed, cfg.deterministic)
        log.info(f"run dir: {run_dir} | {torch.get_num_threads()} CPU threads per process")
        # debug=fast|overfit|anomaly|profile: fewer batches, anomaly mode, profiler
        self.debug = Debug(cfg.debug, run_dir=run_dir, rank=accelerator.process_index)
        self._build(cfg, run_dir)
        self._start(cfg, run_dir)

    # --- building --------------------------------------------------------------------

    def _build(self, cfg: DictConfig, run_dir: Path) -> None:
        """Task, data, model, optimizers, schedule (each checks its own arguments)."""
        accelerator = self.accelerator
        self.task = task = build_task(cfg.task)  # configs/task/: loss, step, evaluation
        resolved = OmegaConf.to_container(cfg, resolve=True)
        refused = warn_what_evaluation_will_refuse(resolved, BUILT_FROM_RUN, cfg.trusted_targets)
        if refused:  # said now, not after hours of training
            log.warning(refused)
        self.loaders = self.debug.loaders(instantiate(cfg.data, what="data"))
        # each sample's random draws (augmentation) a function of (seed, epoch, index)
        self.loaders = exact_loaders(self.loaders, cfg.seed)
        with same_on_every_rank(cfg.seed), built_whole(accelerator):  # ZeRO-3 too
            model = instantiate(base_node(cfg.model), what="model")  # model.peft: below
            # frozen_models: models the step calls but never trains (e.g. a teacher)
            frozen = build_frozen_models(cfg.frozen_models, device=accelerator.device)
        check_model_fits_data(model, cfg.data)  # vocabulary and positions: exit 2
        self.classes = data_classes(self.loaders)  # ImageFolder's classes, if any
        check_model_fits_classes(model, self.classes)  # the head's size: exit 2
        # checkpoint.init_from's weights, then model.peft's adapter (its base fingerprinted)
        model, self.fine_tuned, self.frozen = fine_tune(cfg, model)
        # parallel=fsdp: each repeated block its own FSDP unit, then the root (else a
        # no-op); before the optimizer, which then holds the sharded parameters
        model = shard_model(model, accelerator=accelerator, parallel=cfg.parallel)
        # the task's param_groups (no weight decay on biases, norms and embeddings by
        # default); with optimizers: (several), the groups of each by name
        optimizer = build_optimizers(cfg.optimizer, cfg.optimizers, task.param_groups(model))
        # samples/s, tokens/s and MFU for the logs (before prepare() wraps the model)
        self.throughput = Throughput(
            model,
            accelerator.device,
            accelerator.num_processes,
            accelerator.mixed_precision,  # trainer.mixed_precision with auto resolved
            cfg.trainer.peak_tflops,
        )
        tell_deepspeed_the_micro_batch(accelerator, self.loaders.train)  # else: no-op
        model, optimizer, self.train_loader, self.val_loader = accelerator.prepare(
            model, optimizer, self.loaders.train, self.loaders.val
        )
        self.model, self.optimizer = model, optimizer
        # Where this launch continues from, chosen and verified once on every rank: the
        # checkpoint (none: a fresh start), the accumulation that keeps its global batch
        # on this number of processes, the trackers' run ids (docs/checkpoints.md)
        self.config = resolved  # config.json: nothing above changes cfg
        self.resume = plan_resume(
            cfg.checkpoint,
            config=self.config,
            run_dir=run_dir,
            accelerator=accelerator,
            configured=cfg.trainer.grad_accum_steps,
            model=model,  # a checkpoint whose weights or optimizer state do not fit
            optimizer=optimizer,  # them is skipped, named (checkpoint/judge.py)
            frozen=self.frozen,  # one of trainable weights on another base: exit 2
        )
        self.grad_accum = self.resume.grad_accum
        # The loop's length and cadence, once: the loop runs it, preflight's ETA asks it.
        # A stream (an IterableDataset) has no length: then trainer.max_steps is required.
        self.plan = run_length(
            max_steps=cfg.trainer.max_steps,
            max_epochs=cfg.trainer.max_epochs,
            batches=batches_per_epoch(self.train_loader),
            grad_accum=self.grad_accum,
            eval_every_n_steps=cfg.trainer.eval_every_n_steps,  # null: each epoch
        )
        self.total_steps = self.plan.total_steps
        self.scheduler = accelerator.prepare(
            instantiate_partial(cfg.scheduler, "scheduler", optimizer, total_steps=self.total_steps)
        )
        # trainer.ema: a moving average of the weights (val_ema/*)
        self.ema = WeightAverage(cfg.trainer.ema, model=model, accelerator=accelerator)
        # every metric's last value and every "best" (trainer.monitor's, the best
        # checkpoint's, early stopping's): one book decides them
        self.book = MetricBook(cfg.trainer.monitor, cfg.trainer.monitor_mode)
        self.stopper = EarlyStopping(
            **cfg.trainer.early_stopping,
            monitor=cfg.trainer.monitor,
            mode=cfg.trainer.monitor_mode,
            book=self.book,
        )
        start_trackers(accelerator, cfg, self.resume)  # a resume continues their runs
        watch_model(accelerator, model)  # W&B histograms (tracker.wandb.watch)
        log.info(
            f"{describe_parameters(model)} | {self.total_steps} steps "
            f"({self.plan.steps_per_epoch or 'a stream: ?'}/epoch) | "
            f"world size {accelerator.num_processes} ({accelerator.distributed_type.value})"
        )
        # configs/callbacks/: actions at each step, evaluation, save and the end
        self.callbacks = build_callbacks(cfg.get("callbacks"))
        self._build_state(cfg, run_dir, frozen)

    def _build_state(self, cfg: DictConfig, run_dir: Path, frozen: dict) -> None:
        """The step's verbs, the state, the checkpoints; resume where this run stopped."""
        accelerator, ck = self.accelerator, cfg.checkpoint
        # What the ranks agree on, in one all-reduce when due (agreement.py): a NaN/inf
        # loss (trainer.on_nan: stop or skip) and a stop signal (SIGTERM/SIGUSR1/SIGUSR2/
        # Ctrl-C: save at the next agreed step boundary, then exit; checkpoints on)
        self.guard = LossGuard(
            cfg.trainer.on_nan,
            accelerator,
            skip_budget=cfg.trainer.skip_budget,  # on_nan=skip: at most this many in a row
            clipping=bool(cfg.trainer.grad_clip_norm),
        )
        self.signals = StopSignals(enabled=ck.enabled and ck.save_on_signal)
        self.agreement = StepAgreement(
            accelerator=accelerator,
            guard=self.guard,
            signals=self.signals,
            every_n_steps=cfg.trainer.log_every_n_steps,
        )
        # The verbs of the task's training_step: accumulation, backward with the NaN
        # guard, clipping (trainer.grad_clip_norm), the update, over the named models
        self.step = Step(
            accelerator=accelerator,
            agreement=self.agreement,
            clip_norm=cfg.trainer.grad_clip_norm,
            models={"model": self.model, **frozen},
            optimizer=self.optimizer,
            frozen=tuple(frozen),
        )
        self.clock = RunClock()  # training time of the whole run, across resumes
        self.window = WindowMeans(accelerator)  # train/loss and the task's logs, summed
        self.state = TrainState(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            train_loader=self.train_loader,
            val_loader=self.val_loader,
            task=self.task,
            step=self.step,
            # saved in checkpoints: trainer_state.json (tensors: <name>.safetensors)
            stateful={
                "metrics": self.book,
                "clock": self.clock,
                "log_window": self.window,  # a window a checkpoint cuts: its sums so far
                "early_stopping": self.stopper,
                **self.ema.stateful,
                **stateful(self.callbacks),  # callbacks.<name>: one with state_dict()
            },
        )
        self.ckpt = CheckpointManager(
            checkpoint=ck,
            config=self.config,
            run_dir=run_dir,
            accelerator=accelerator,
            state=self.state,
            book=self.book,  # which step was a new best of checkpoint.save_best.monitor
            agreement=self.agreement,  # before every save: no checkpoint after a NaN
            timeout_s=cfg.parallel.timeout_s,
            frozen=self.frozen,  # checkpoint.weights: the trainable state alone (base.py)
        )
        self.start_at = self.ckpt.restore(self.resume)  # 0 unless resuming; every state
        self.step_count, self.epoch = self.start_at.step, self.start_at.epoch
        # a group restarted in the job (parallel.max_restarts): what failed, what it cost
        note_recovery(run_dir, self.resume, accelerator)
        # -m hparams_search=optuna: this job's trial, told every evaluation (else no-op)
        self.trial = TrialReporter.from_config(
            cfg.get("optuna_trial"), accelerator=accelerator, run_dir=run_dir
        )

    def _start(self, cfg: DictConfig, run_dir: Path) -> None:
        """Preflight, then the loop's own parts: progress, watchdog, the event list."""
        accelerator = self.accelerator
        # preflight: devices, memory, disk, checkpoint round trip, speed and ETA. A
        # failed check raises PreflightFailed (exit 1); the state is left as it was.
        run_preflight(
            cfg,
            run_dir=run_dir,
            accelerator=accelerator,
            state=self.state,
            ckpt=self.ckpt,
            plan=self.plan,
            throughput=self.throughput,
            start_step=self.step_count,
        )
        commit_attempt(run_dir, accelerator)  # training starts: the staged config.json
        if accelerator.is_main_process:  # class names for predict.py and load_model
            write_classes(run_dir, self.classes)
        if cfg.preflight.only:  # preflight.only=true: the report was all we wanted
            accelerator.wait_for_everyone()
            accelerator.end_training()
            self.done = True
            return
        self.progress = Progress(self.total_steps, initial_step=self.step_count, clock=self.clock)
        self.data = None  # the latest batch (its size counts the summary's samples)
        self.log_every = cfg.trainer.log_every_n_steps  # read every step: a plain int
        self.stop = False  # the ranks agreed that a stop signal came (agreement.at_step)
        # Hang detection: each phase of the loop (first step, step, eval, save) has a
        # budget; a rank past it writes its stacks to hangs/, names the ranks that made
        # no progress and exits 5; the launcher restarts the group (docs/recovery.md)
        self.watchdog = Watchdog(
            cfg.watchdog,
            run_dir=run_dir,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
        )
        # What every optimizer step, evaluation and save is followed by, in this order:
        # the schedule (per step, or on trainer.monitor after an evaluation), the weight
        # average, the watchdog's heartbeat, progress, debug's profiler, early
        # stopping's patience, then the callbacks of configs/callbacks/. Those switched
        # off in this run are left out: each call is a few us of every step.
        schedule = ScheduleSteps(self.scheduler, monitor=cfg.trainer.monitor)
        self.events = Callbacks(
            [
                schedule,
                self.ema if self.ema.enabled else None,
                self.watchdog if self.watchdog.enabled else None,
                self.progress,
                self.debug if self.debug.profile else None,
                self.stopper,
                *self.callbacks.values(),
            ]
        )
        self.run = RunContext(
            accelerator=accelerator,
            run_dir=run_dir,
            task=self.task,
            models=self.step.models,
            media=Media(accelerator, run_dir),  # images, histograms, texts to trackers
            total_steps=self.total_steps,
            step=self.step_count,
            extras={"val_loader": self.val_loader},
        )

    # --- the loop --------------------------------------------------------------------

    def _ended(self) -> bool:
        return self.step_count == self.total_steps or self.stop or self.stopper.stopped

    def batches(self) -> Iterator[Any]:
        """The run's batches, in order, from where it stands; ends when the run does
        (its length, a stop signal the ranks agreed on, early stopping)."""
        self.clock.start()
        self.debug.start()
        self.watchdog.start(self.step_count)
        self.model.train()
        if self.cfg.trainer.eval_at_start and self.step_count == 0:
            self.evaluate(0)  # where a fresh run (a fine-tune) starts; logged at step 0
        for epoch in range(self.start_at.epoch, self.plan.max_epochs):
            self.epoch = epoch  # also when it ends here: the summary counts it
            if self._ended():
                return
            self.train_loader.set_epoch(epoch)
            # batches a resumed run already saw of its epoch
            done = self.start_at.batch if epoch == self.start_at.epoch else 0
            batches = continue_epoch(
                self.train_loader,
                epoch=epoch,
                batches_done=done,
                num_processes=self.accelerator.num_processes,
            )
            for self._batch, self.data in enumerate(batches, start=done + 1):
                yield self.data
                if self._ended():
                    return

    def log_step(self, loss: torch.Tensor, logs: dict[str, torch.Tensor]) -> None:
        """train/loss and the task's logs of one micro-batch, into the log window."""
        self.window.add(loss, logs)

    def after_update(self) -> None:
        """After each optimizer step: the events, the logs, the ranks' agreement (a
        NaN/inf loss stops here, naming its step), evaluation, checkpoints, pruning."""
        book = self.book
        step = self.step_count = self.state.advance(self.epoch, self._batch)
        moments.reached("first_step" if step == self.start_at.step + 1 else "step", step)
        self.run.step, self.run.epoch = step, self.epoch
        self.events.on_step_end(self.run)

        # every rank: a NaN/inf loss stops here (naming its step); a stop signal agreed.
        # At a log step the window's sums ride in the same collective (one, not two).
        if step % self.log_every == 0:
            try:
                self.stop = self.agreement.at_step(step, carry=self.window.sums)
            except NonFiniteLoss:
                self._log(step)  # the window that held it, logged before the stop
                raise
            self._log(step)
        else:
            self.stop = self.agreement.at_step(step)

        if step % self.plan.eval_every == 0 or step == self.total_steps:
            self.evaluate(step)

        # every N steps/epochs, a new best, after a stop signal
        reasons = self.ckpt.due(metrics=book.last, stop=self.stop)
        if reasons:  # the same on every rank: the rules read agreed values only
            with self.clock.excluded("ckpt_blocking"), self.watchdog.phase("save"):
                saved = self.ckpt.save_due(reasons)
            self.events.on_save(self.run, saved)
        self.trial.report_and_check(step, book)  # Optuna pruning: raises TrialPruned

    def _log(self, step: int) -> None:
        """A log step's metrics: the window's means over the ranks, the rates, the clock."""
        rate = self.progress.window_rate(step)
        samples, tokens = self.task.batch_size(batch=self.data)
        norm = self.step.grad_norm  # the last clipping's (None: no clipping yet)
        metrics = {
            **self.window.means(self.agreement.carried),  # train/loss, train/<log>: every rank
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/grad_norm": 0.0 if norm is None else float(norm),
            "train/epoch": self.epoch + 1,
            "perf/steps_per_sec": rate,
            **self.throughput.metrics(
                rate,
                samples=samples * self.grad_accum,
                tokens=None if tokens is None else tokens * self.grad_accum,
            ),
            **self.clock.metrics(),  # perf/eval_s, perf/ckpt_blocking_s
        }
        self.book.update(metrics, step, require_monitor=self.book.monitor.startswith("train/"))
        self.accelerator.log(metrics, step=step)
        self.progress.report(step, metrics)

    def evaluate(self, step: int) -> dict[str, float]:
        """The task's evaluation (and the weight average's), logged; the events."""
        task, loader, accelerator = self.task, self.val_loader, self.accelerator
        with self.clock.excluded("eval"), self.watchdog.phase("eval"):
            metrics = task.evaluate(model=self.model, loader=loader, accelerator=accelerator)
            metrics |= self.ema.evaluate(task=task, loader=loader, accelerator=accelerator)
        self.book.update(metrics, step, require_monitor=True)
        accelerator.log(metrics, step=step)
        self.progress.report(step, metrics)
        moments.reached("eval", step)
        self.events.on_eval_end(self.run, metrics)  # early stopping, then the callbacks
        return metrics

    # --- the end ---------------------------------------------------------------------

    def finish(self) -> float | None:
        """The end of a run, committed like a save, through moments.LIFE's end: the
        last checkpoint, the final weights, the trackers' last writes and finish, then
        summary.json LAST (it records the weights' size and checksum): a kill before it
        leaves no finished run, and the rerun completes the end from the last checkpoint
        (docs/run-dir.md). Returns the best value of trainer.monitor."""
        accelerator, book, run_dir = self.accelerator, self.book, self.run_dir
        step = self.step_count
        self.debug.finish()
        self.progress.close()
        self.stop = self.agreement.at_step(step, final=True)  # how the loop ended: agreed
        with self.clock.excluded("ckpt_blocking"), self.watchdog.phase("save"):
            saved = self.ckpt.finish(metrics=book.last, stop=self.stop)  # the last one
        if saved is not None:
            self.events.on_save(self.run, saved)
        moments.reached("final_checkpoint", step)
        self.watchdog.close()
        self.signals.finish(stopped=self.stop, saved=self.ckpt.last_saved)  # a stop: exit
        self.events.on_train_end(self.run)

        wall = self.clock.elapsed()
        summary = run_summary(self, step, wall)  # summary.json's, but the final weights
        plain = plain_model(accelerator, self.model)  # no DDP/compile wrapper
        log.info(f"final weights fingerprint {weights_fingerprint(plain)}")
        writing = "model.safetensors"  # what a full or read-only disk refused: said
        try:  # model.safetensors: the trainable state alone when the checkpoints hold it
            weights = save_final_weights(accelerator, self.model, run_dir, self.ckpt.trainable_base)
            writing = "the trackers' files"
            log_final_model(accelerator, self.cfg, run_dir, self.loaders.val, task=self.task)
            moments.reached("trackers", step)
            finish_trackers(accelerator)  # flushed and closed before the run says finished
            writing = "summary.json"
            write_summary(run_dir, {**summary, "final_weights": weights})  # the commit record
        except OSError as err:
            raise end_not_written(run_dir, writing, err) from err
        log.info(
            f"done: {step} steps in {wall:.1f}s | "
            + " | ".join(f"{k} {v:.4f}" for k, v in book.last.items() if k.startswith("val/"))
            + f" | best {book.monitor} {book.best_value:.4f} at step {book.best_step}"
            + (
                f" | {self.guard.skipped} updates dropped (on_nan=skip)"
                if self.guard.mode == "skip"
                else ""
            )
            + f" | summary: {run_dir / 'summary.json'}"
        )
        moments.reached("exit", step)
        accelerator.wait_for_everyone()  # gloo can abort at exit without this barrier
        accelerator.end_training()  # the process group (the trackers finished above)
        return book.best_value
