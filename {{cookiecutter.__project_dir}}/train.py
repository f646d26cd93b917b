"""Train the configured model. Read top to bottom: this file is the recipe.

    python train.py                                  # defaults from configs/train.yaml
    python train.py model=cnn optimizer.lr=3e-3      # override anything
    python train.py -m optimizer.lr=1e-3,1e-2 seed=1,2   # a sweep
    python train.py run_name=exp1                    # rerun after a crash: resumes in runs/exp1
                                                     # (a finished run: reports it, changes nothing)

The task (what a batch is, the loss, the training step, the evaluation) is an object
built from configs/task/ (src/{{ cookiecutter.package_name }}/tasks/); callbacks from
configs/callbacks/. Everything else (run directory, checkpoints, signals, trackers,
seeding, progress) lives in the engine's small modules, which decide about ranks
themselves (README: "Layout").
"""

import logging
import sys
from functools import partial
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from training_engine.accel import build_accelerator, weights_fingerprint
from training_engine.agreement import StepAgreement
from training_engine.callbacks import (
    Callbacks,
    RunContext,
    build_callbacks,
    stateful,
)
from training_engine.checkpoint import (
    CheckpointError,
    CheckpointManager,
    plain_model,
    plan_resume,
    save_final_weights,
)
from training_engine.claim import Decision, agree, claim, commit_attempt
from training_engine.config import (
    ConfigError,
    check_config,
    instantiate,
    register_resolvers,
    resolve_config,
)
from training_engine.debug import Debug
from training_engine.early_stopping import EarlyStopping
from training_engine.ema import WeightAverage, metric_names
from training_engine.entry import run_entry_point
from training_engine.finetune import init_from
from training_engine.fits import check_model_fits_data
from training_engine.frozen import build_frozen_models
from training_engine.fsdp import shard_model
from training_engine.launch import (
    LaunchError,
    adopt_pet_env,
    run,
    runs_alone,
    spans_nodes,
)
from training_engine.loaders import batches_per_epoch, continue_epoch, run_length
from training_engine.logs import setup_rank_logging
from training_engine.media import Media
from training_engine.metrics import MetricBook, WindowMeans
from training_engine.nonfinite import LossGuard, NonFiniteLoss
from training_engine.optimizers import build_optimizers
from training_engine.preemption import StopSignals, TrainingInterrupted
from training_engine.preflight import PreflightFailed, run_preflight
from training_engine.progress import Progress, RunClock
from training_engine.pruning import TrialPruned, TrialReporter
from training_engine.recovery import history, note_recovery
from training_engine.run_dir import (
    check_run_name,
    check_shared_storage,
    hydra_run_dir,
    hydra_run_dir_as_written,
    in_sweep,
    made_by_this_launch,
    uses_default_run_name,
    write_summary,
)
from training_engine.schedules import ScheduleSteps
from training_engine.seeding import same_on_every_rank, seed_everything
from training_engine.state import TrainState
from training_engine.step import Step
from training_engine.task import build_task
from training_engine.throughput import Throughput
from training_engine.tracking import (
    check_reachable,
    log_final_model,
    start_trackers,
    watch_model,
)
from training_engine.watchdog import Watchdog

log = logging.getLogger("train")
PROJECT_ROOT = Path(__file__).resolve().parent  # runs_root's default: <project root>/runs
CONFIG_DIR = PROJECT_ROOT / "configs"
# What the loop logs itself, besides the task's own train/<log>s; the task's ``metrics``
# are its evaluation's (trainer.monitor picks one).
TRAIN_METRICS = ("train/loss", "train/lr", "train/grad_norm", "train/epoch")


def train(cfg: DictConfig, run_dir: Path, decision: Decision | None = None) -> float | None:
    """One process's training; runs on every rank (see launch.py). Returns the
    best value of trainer.monitor (None with preflight.only=true). ``decision``:
    the launch's main process's claim of the run dir (None on the other processes)."""
    # --- logging, accelerator, seeds -------------------------------------------------
    accelerator = build_accelerator(cfg, run_dir)
    # Every rank takes the main process's decision about the run dir (a collective: a
    # process launched with other values than the main one's stops them all here).
    decision = agree(decision, cfg=cfg, run_dir=run_dir, accelerator=accelerator)
    if decision.finished:  # some other launcher's process had to be told
        setup_rank_logging(run_dir, files=False)
        accelerator.end_training()
        return report_finished(run_dir, decision.summary)
    # Every rank sees the dir the main process writes (a collective: after it, the
    # main process has claimed the dir, so the other ranks may write there too).
    check_shared_storage(run_dir, accelerator)
    setup_rank_logging(run_dir)
    seed_everything(cfg.seed, cfg.deterministic)
    log.info(f"run dir: {run_dir} | {torch.get_num_threads()} CPU threads per process")
    # debug=fast|overfit|anomaly|profile: fewer batches, anomaly mode, profiler (none: off)
    debug = Debug(**cfg.debug, run_dir=run_dir, rank=accelerator.process_index)

    # --- task, data, model, optimizer, schedule (they check their own arguments) -----
    task = build_task(cfg.task)  # configs/task/: the loss, the training step, the evaluation
    loaders = debug.loaders(instantiate(cfg.data, what="data"))
    with same_on_every_rank(cfg.seed):
        model = instantiate(cfg.model, what="model")
        # frozen_models: models the step calls but never trains (e.g. a teacher)
        frozen = build_frozen_models(cfg.frozen_models, device=accelerator.device)
    check_model_fits_data(model, cfg.data)  # vocabulary and positions: exit 2 naming both
    # checkpoint.init_from: a new run starting from another run's weights (fine-tuning)
    fine_tuned = init_from(cfg.checkpoint, model=model)
    # parallel=fsdp: each repeated block its own FSDP unit, then the root (else a no-op);
    # before the optimizer, which then holds the sharded parameters
    model = shard_model(model, accelerator=accelerator, parallel=cfg.parallel)
    # the task's param_groups: no weight decay on biases, norms and embeddings by default;
    # with optimizers: (several), the groups of each by name (optimizers.py)
    optimizer = build_optimizers(cfg.optimizer, cfg.optimizers, task.param_groups(model))
    # samples/s, tokens/s and MFU for the logs (before prepare() wraps the model)
    throughput = Throughput(
        model,
        accelerator.device,
        accelerator.num_processes,
        accelerator.mixed_precision,  # trainer.mixed_precision with auto resolved
        cfg.trainer.peak_tflops,
    )
    model, optimizer, train_loader, val_loader = accelerator.prepare(
        model, optimizer, loaders.train, loaders.val
    )
    # Where this launch continues from, chosen and verified once on every rank: the
    # checkpoint (none: a fresh start), the accumulation that keeps its global batch on
    # this number of processes, the trackers' run ids (docs/checkpoints.md, "Resume")
    config = OmegaConf.to_container(cfg, resolve=True)  # config.json; compared on resume
    resume = plan_resume(
        cfg.checkpoint,
        config=config,
        run_dir=run_dir,
        accelerator=accelerator,
        configured=cfg.trainer.grad_accum_steps,
    )
    grad_accum = resume.grad_accum
    # The loop's length and cadence, once: the loop runs it, preflight's ETA asks it.
    # A stream (an IterableDataset) has no length: then trainer.max_steps is required.
    plan = run_length(
        max_steps=cfg.trainer.max_steps,
        max_epochs=cfg.trainer.max_epochs,
        batches=batches_per_epoch(train_loader),
        grad_accum=grad_accum,
        eval_every_n_steps=cfg.trainer.eval_every_n_steps,  # null: each epoch (a stream: end)
    )
    steps_per_epoch, total_steps = plan.steps_per_epoch, plan.total_steps
    scheduler = accelerator.prepare(
        instantiate(cfg.scheduler, what="scheduler")(optimizer, total_steps=total_steps)
    )
    # trainer.ema: a moving average of the weights (val_ema/*); early stopping on monitor
    ema = WeightAverage(**cfg.trainer.ema, model=model, accelerator=accelerator)
    # every metric's last value and every "best" (trainer.monitor's, the best checkpoint's,
    # early stopping's): one book decides them
    book = MetricBook(cfg.trainer.monitor, cfg.trainer.monitor_mode)
    stopper = EarlyStopping(
        **cfg.trainer.early_stopping,
        monitor=cfg.trainer.monitor,
        mode=cfg.trainer.monitor_mode,
        book=book,
    )
    start_trackers(accelerator, cfg, resume)  # a resume continues the trackers' runs
    watch_model(accelerator, model)  # W&B gradient/parameter histograms (tracker.wandb.watch)
    log.info(
        # ZeRO-3 partitions the parameters: ds_numel is the full count
        f"{sum(getattr(p, 'ds_numel', p.numel()) for p in model.parameters()):,} parameters | "
        f"{total_steps} steps ({steps_per_epoch or 'a stream: ?'}/epoch) | "
        f"world size {accelerator.num_processes} "
        f"({accelerator.distributed_type.value})"
    )

    # configs/callbacks/: actions at each step, evaluation, save and the end (callbacks.py)
    callbacks = build_callbacks(cfg.get("callbacks"))

    # --- the state; checkpoints: resume where an earlier run of this run dir stopped --
    # What the ranks agree on, in one all-reduce when due (agreement.py): a NaN/inf loss
    # (trainer.on_nan: stop or skip) and a stop signal (SIGTERM/SIGUSR1/SIGUSR2/Ctrl-C:
    # save at the next agreed step boundary, then exit; checkpoints on)
    ck = cfg.checkpoint
    guard = LossGuard(
        cfg.trainer.on_nan,
        accelerator,
        skip_budget=cfg.trainer.skip_budget,  # on_nan=skip: at most this many in a row
        clipping=bool(cfg.trainer.grad_clip_norm),
    )
    signals = StopSignals(enabled=ck.enabled and ck.get("save_on_signal", True))
    agreement = StepAgreement(
        accelerator=accelerator,
        guard=guard,
        signals=signals,
        every_n_steps=cfg.trainer.log_every_n_steps,
    )
    # The verbs of the task's training_step: accumulation, backward with the NaN guard,
    # clipping (trainer.grad_clip_norm) and the update, over the named models/optimizers
    step_verbs = Step(
        accelerator=accelerator,
        agreement=agreement,
        clip_norm=cfg.trainer.grad_clip_norm,
        models={"model": model, **frozen},
        optimizer=optimizer,
        frozen=tuple(frozen),
    )
    clock = RunClock()  # training time of the whole run, across resumes
    state = TrainState(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_loader=train_loader,
        val_loader=val_loader,
        task=task,
        step=step_verbs,
        # saved in checkpoints: trainer_state.json (tensors: <name>.safetensors)
        stateful={
            "metrics": book,
            "clock": clock,
            "early_stopping": stopper,
            **ema.stateful,
            **stateful(callbacks),  # callbacks.<name>: a callback with state_dict()
        },
    )
    ckpt = CheckpointManager(
        checkpoint=cfg.checkpoint,
        config=config,
        run_dir=run_dir,
        accelerator=accelerator,
        state=state,
        book=book,  # which step was a new best of checkpoint.save_best.monitor
        agreement=agreement,  # before every save: no checkpoint after a NaN
        timeout_s=cfg.parallel.get("timeout_s") or 1800,
    )
    start_at = ckpt.restore(resume)  # step/epoch/batch 0 unless resuming; every state
    step, epoch = start_at.step, start_at.epoch
    # a group restarted in the job (parallel.max_restarts): what failed, what it cost
    note_recovery(run_dir, resume, accelerator)
    # -m hparams_search=optuna: this job's trial, told every evaluation (else a no-op)
    trial = TrialReporter.from_config(
        cfg.get("optuna_trial"), accelerator=accelerator, run_dir=run_dir
    )

    # --- preflight: devices, memory, disk, checkpoint round trip, speed and ETA -------
    # A failed check raises PreflightFailed (exit 1); the state is left as it was.
    run_preflight(
        cfg,
        run_dir=run_dir,
        accelerator=accelerator,
        state=state,
        ckpt=ckpt,
        plan=plan,
        throughput=throughput,
        start_step=step,
    )
    commit_attempt(run_dir, accelerator)  # training starts: the staged config.json is the run's
    if cfg.preflight.only:  # preflight.only=true: the report was all we wanted
        accelerator.wait_for_everyone()
        accelerator.end_training()
        return None

    # --- the loop ----------------------------------------------------------------------
    progress = Progress(total_steps, initial_step=step, clock=clock)  # rates: training time
    eval_every, log_every = plan.eval_every, cfg.trainer.log_every_n_steps
    window = WindowMeans(accelerator)  # train/loss and the task's logs: summed on the device
    data = None  # the latest batch (its size counts the summary's samples and tokens)
    stop = False  # the ranks agreed that a stop signal came (agreement.at_step)
    # Hang detection: each phase of the loop (first step, step, eval, save) has a
    # budget; a rank past it writes its stacks to hangs/, names the ranks that made
    # no progress and exits 5, and the launcher restarts the group (docs/recovery.md)
    watchdog = Watchdog(
        cfg.watchdog,
        run_dir=run_dir,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
    )
    # What every optimizer step, evaluation and save is followed by, in this order: the
    # schedule (per step, or on trainer.monitor after an evaluation: ReduceLROnPlateau),
    # the weight average, the watchdog's heartbeat, progress, debug's profiler, early
    # stopping's patience, then the callbacks of configs/callbacks/
    schedule = ScheduleSteps(scheduler, monitor=cfg.trainer.monitor)
    events = Callbacks([schedule, ema, watchdog, progress, debug, stopper, *callbacks.values()])
    run = RunContext(
        accelerator=accelerator,
        run_dir=run_dir,
        task=task,
        models=step_verbs.models,
        media=Media(accelerator, run_dir),  # images, histograms, texts to every tracker
        total_steps=total_steps,
        step=step,
        extras={"val_loader": val_loader},
    )
    clock.start()
    debug.start()
    watchdog.start(step)
    model.train()
    for epoch in range(start_at.epoch, plan.max_epochs):
        if step == total_steps or stop or stopper.stopped:
            break
        train_loader.set_epoch(epoch)
        done = start_at.batch if epoch == start_at.epoch else 0  # batches a resumed run saw
        batches = continue_epoch(
            train_loader, epoch=epoch, batches_done=done, num_processes=accelerator.num_processes
        )
        for batch, data in enumerate(batches, start=done + 1):
            # the task's step: forward, loss, backward; at the accumulation's end clipping
            # and the update (the default: training_engine/task.py, TaskDefaults.training_step)
            loss, logs = task.training_step(step=step_verbs, batch=data)
            window.add(loss, logs)
            if not step_verbs.update_done():
                continue  # still accumulating micro-batches
            step = state.advance(epoch, batch)  # TrainState keeps where training is
            run.step, run.epoch = step, epoch
            events.on_step_end(run)

            if step % log_every == 0:
                rate = progress.window_rate(step)
                samples, tokens = task.batch_size(batch=data)
                norm = step_verbs.grad_norm  # the last clipping's (None: no clipping yet)
                metrics = {
                    **window.means(),  # train/loss, train/<log>: over the window, every rank
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/grad_norm": 0.0 if norm is None else float(norm),
                    "train/epoch": epoch + 1,
                    "perf/steps_per_sec": rate,
                    **throughput.metrics(
                        rate,
                        samples=samples * grad_accum,
                        tokens=None if tokens is None else tokens * grad_accum,
                    ),
                    **clock.metrics(),  # perf/eval_s, perf/ckpt_blocking_s: not in the rates
                }
                book.update(metrics, step, require_monitor=book.monitor.startswith("train/"))
                accelerator.log(metrics, step=step)
                progress.report(step, metrics)

            # every rank: a NaN/inf loss stops here (naming its step); a stop signal agreed
            stop = agreement.at_step(step)

            if step % eval_every == 0 or step == total_steps:
                with clock.excluded("eval"), watchdog.phase("eval"):
                    metrics = task.evaluate(model=model, loader=val_loader, accelerator=accelerator)
                    metrics |= ema.evaluate(task=task, loader=val_loader, accelerator=accelerator)
                book.update(metrics, step, require_monitor=True)
                accelerator.log(metrics, step=step)
                progress.report(step, metrics)
                events.on_eval_end(run, metrics)  # early stopping, then the callbacks

            # every N steps/epochs, a new best, after a stop signal
            with clock.excluded("ckpt_blocking"), watchdog.phase("save"):
                saved = ckpt.maybe_save(metrics=book.last, stop=stop)
            if saved is not None:
                events.on_save(run, saved)
            trial.report_and_check(step, book)  # Optuna pruning: raises TrialPruned (saved first)
            if step == total_steps or stop or stopper.stopped:
                break
    debug.finish()
    progress.close()
    stop = agreement.at_step(step, final=True)  # every rank agrees on how the loop ended
    with clock.excluded("ckpt_blocking"), watchdog.phase("save"):
        saved = ckpt.finish(metrics=book.last, stop=stop)  # the last checkpoint
    if saved is not None:
        events.on_save(run, saved)
    watchdog.close()
    signals.finish(stopped=stop, saved=ckpt.last_saved)  # a stop: exit (SLURM: requeue)
    events.on_train_end(run)

    # --- summary and final weights -----------------------------------------------------
    # In this order: the final weights, the tracker's copy, then summary.json LAST (it
    # records the weights' size and checksum). A kill before it leaves no finished run:
    # the rerun completes the end from the last checkpoint (docs/run-dir.md).
    wall = clock.elapsed()
    if data is None and step > 0:  # an end completed from the last checkpoint: no batch
        data = next(iter(train_loader))  # seen in this attempt; one, to size the rates
    samples, tokens = task.batch_size(batch=data) if data is not None else (0, None)
    summary = {
        "step": step,
        "epoch": epoch + 1,
        "world_size": accelerator.num_processes,
        "wall_time_s": round(wall, 3),  # the whole run's loop (every attempt), all included
        "steps_per_sec": round(step / wall, 3) if wall > 0 else 0.0,  # over wall_time_s
        # the same run's rates over training time only, and what was left out
        "rates": throughput.summary(step, wall, clock.excluded_s, samples, tokens, grad_accum),
        "metrics": book.last,
        "best": book.best(),
        "resumed_from": ckpt.resumed_from,  # null for a fresh start
        "skipped_nan_steps": guard.skipped,
        "recoveries": history(run_dir),  # in-job restarts, every launch's (recovery.py)
        **fine_tuned,  # checkpoint.init_from: the source and the keys that did not fit
        **stopper.summary(),  # trainer.early_stopping: whether, when and why it stopped
    }
    plain = plain_model(accelerator, model)  # no DDP/compile wrapper
    log.info(f"final weights fingerprint {weights_fingerprint(plain)}")
    weights = save_final_weights(accelerator, model, run_dir)  # model.safetensors: its entry
    log_final_model(accelerator, cfg, run_dir, loaders.val, task=task)  # MLflow: model, weights
    write_summary(run_dir, {**summary, "final_weights": weights})  # the commit record
    log.info(
        f"done: {step} steps in {wall:.1f}s | "
        + " | ".join(f"{k} {v:.4f}" for k, v in book.last.items() if k.startswith("val/"))
        + f" | best {book.monitor} {book.best_value:.4f} at step {book.best_step}"
        + (f" | {guard.skipped} updates dropped (on_nan=skip)" if guard.mode == "skip" else "")
        + f" | summary: {run_dir / 'summary.json'}"
    )
    accelerator.wait_for_everyone()  # gloo can abort at exit without this barrier
    accelerator.end_training()
    return book.best_value


def report_finished(run_dir: Path, summary: dict) -> float | None:
    """A rerun of a finished run: say so, change nothing; its best value for sweepers."""
    best = summary["best"]
    log.info(
        f"{run_dir} is a finished run (step {summary['step']}, best {best['name']} "
        f"{best['value']} at step {best['step']}): nothing to do, nothing changed. Raise "
        "trainer.max_steps/max_epochs to continue it, or use another run_name"
    )
    return best["value"]


def launch(raw: DictConfig) -> float | None:
    """Check the config, claim the run dir, train (here or in spawned workers)."""
    cfg = resolve_config(raw)  # plain and resolved: no ${...}, no Hydra state needed
    adopt_pet_env(cfg.parallel)  # in a Kubeflow Trainer pod: nodes, rank, rendezvous from PET_*
    check_config(cfg)
    check_run_name(cfg)  # inside runs_root
    task = build_task(cfg.task)  # a task that lacks a method the engine calls: exit 2 here
    monitored = (*TRAIN_METRICS, *task.metrics, *metric_names(cfg.trainer.ema, task.metrics))
    if cfg.trainer.monitor not in monitored and not cfg.trainer.monitor.startswith(
        ("perf/", "train/")
    ):
        raise ConfigError(
            f"trainer.monitor={cfg.trainer.monitor!r} is not a logged metric; available: "
            + ", ".join(monitored)
        )
    if uses_default_run_name(raw) and spans_nodes(cfg.parallel):
        raise ConfigError(
            "a run on several nodes needs one run directory, but the default run_name is "
            "each node's own launch time: give every node's command the same run_name=NAME "
            "(or hydra.run.dir=DIR on storage every node shares)"
        )
    check_reachable(cfg)  # a tracking server that does not answer: exit 2 in seconds
    run_dir = hydra_run_dir()
    # The main process decides (new, continue, finished, or refused: exit 2); an attempt
    # that fails before its first step is taken back (claim.py).
    with claim(run_dir, cfg, raw) as claimed:
        decision = claimed.decision
        if decision is not None and decision.finished and runs_alone(cfg.parallel):
            return report_finished(run_dir, decision.summary)
        return run(partial(train, decision=decision), cfg, run_dir)  # here, or in N workers


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    register_resolvers(PROJECT_ROOT)  # again: SLURM job processes never ran __main__
    try:
        return launch(cfg)
    except (ConfigError, LaunchError, CheckpointError, NonFiniteLoss, PreflightFailed) as err:
        log.error(str(err))  # exit codes: 2 bad input, 1 failure, 3 NaN/inf loss (entry.py)
        if in_sweep():
            raise  # Hydra marks the job failed, runs the others, and the sweep exits 1
        if err.exit_code == 2:
            made_by_this_launch(hydra_run_dir_as_written(), remove=True)  # bad input: nothing left
        sys.exit(err.exit_code)
    except TrialPruned as err:  # an Optuna trial stopped by its pruner (exit code 4)
        log.info(str(err))
        if in_sweep():
            raise  # the sweeper records the trial as PRUNED and goes on
        sys.exit(err.exit_code)
    except TrainingInterrupted as err:  # SIGTERM 143, SIGUSR1 138, SIGUSR2 140: restart to resume
        log.warning(str(err))
        sys.exit(err.exit_code)


if __name__ == "__main__":
    register_resolvers(PROJECT_ROOT)
    run_entry_point(main, CONFIG_DIR, "train")  # Hydra's command-line errors: exit 2 too
