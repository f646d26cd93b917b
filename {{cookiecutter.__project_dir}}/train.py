"""Train the configured model. Read top to bottom: this file is the recipe.

    python train.py                                  # defaults from configs/train.yaml
    python train.py model=cnn optimizer.lr=3e-3      # override anything
    python train.py -m optimizer.lr=1e-3,1e-2 seed=1,2   # a sweep
    python train.py run_name=exp1                    # rerun after a crash: resumes in runs/exp1

Everything else (run directory, trackers, seeding, progress) lives in small
modules under src/{{ cookiecutter.package_name }}/ that decide about ranks themselves.
"""

import logging
import math
import sys
import time
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from accelerate import skip_first_batches
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from {{ cookiecutter.package_name }}.accel import build_accelerator, weights_fingerprint
from {{ cookiecutter.package_name }}.checkpoint import (
    CheckpointError,
    CheckpointManager,
    TrainingInterrupted,
)
from {{ cookiecutter.package_name }}.config_checks import ConfigError, check_config
from {{ cookiecutter.package_name }}.launch import LaunchError, run, setup_rank_logging
from {{ cookiecutter.package_name }}.metrics import MetricBook
from {{ cookiecutter.package_name }}.nonfinite import LossGuard, NonFiniteLoss
from {{ cookiecutter.package_name }}.perf import Throughput
from {{ cookiecutter.package_name }}.preflight import PreflightFailed, run_preflight
from {{ cookiecutter.package_name }}.progress import Progress
from {{ cookiecutter.package_name }}.pruning import TrialPruned, TrialReporter
from {{ cookiecutter.package_name }}.run_dir import (
    hydra_run_dir,
    in_sweep,
    register_resolvers,
    resolve_config,
    save_resolved_config,
    write_summary,
)
from {{ cookiecutter.package_name }}.seeding import same_on_every_rank, seed_everything
from {{ cookiecutter.package_name }}.tracking import flatten_config, log_final_model, watch_model

log = logging.getLogger("train")


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, **kwargs) -> torch.Tensor:
    """Class labels (batch,) or token targets (batch, positions): each position
    is one prediction, so both flatten to rows of logits."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), **kwargs)


def compute_loss(model, x, y) -> torch.Tensor:
    """The training objective of one micro-batch ``(x, y)`` of the train loader;
    the loop and preflight's timed steps use it."""
    return cross_entropy(model(x), y)


@torch.no_grad()
def evaluate(model, loader, accelerator) -> dict[str, float]:
    """Loss and accuracy over the whole validation set, summed across ranks."""
    model.eval()
    loss_sum = torch.zeros((), device=accelerator.device)
    correct = torch.zeros((), device=accelerator.device)
    count = torch.zeros((), device=accelerator.device)
    for x, y in loader:
        logits = model(x)
        logits, y = accelerator.gather_for_metrics((logits, y))
        loss_sum += cross_entropy(logits.float(), y, reduction="sum")
        correct += (logits.argmax(dim=-1) == y).sum()
        count += y.numel()
    model.train()
    return {"val/loss": (loss_sum / count).item(), "val/acc": (correct / count).item()}


def train(cfg: DictConfig, run_dir: Path) -> float | None:
    """One process's training; runs on every rank (see launch.py). Returns the
    best value of trainer.monitor (None with preflight.only=true)."""
    # --- logging, accelerator, seeds -------------------------------------------------
    setup_rank_logging(run_dir)
    accelerator = build_accelerator(cfg, run_dir)
    seed_everything(cfg.seed, cfg.deterministic)
    log.info(f"run dir: {run_dir}")

    # --- data, model, optimizer, schedule --------------------------------------------
    loaders = instantiate(cfg.data)
    with same_on_every_rank(cfg.seed):
        model = instantiate(cfg.model)
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    # samples/s, tokens/s and MFU for the logs (before prepare() wraps the model)
    throughput = Throughput(
        model, accelerator, cfg.trainer.mixed_precision, cfg.trainer.peak_tflops
    )
    model, optimizer, train_loader, val_loader = accelerator.prepare(
        model, optimizer, loaders.train, loaders.val
    )
    steps_per_epoch = math.ceil(len(train_loader) / cfg.trainer.grad_accum_steps)
    total_steps = cfg.trainer.max_steps or cfg.trainer.max_epochs * steps_per_epoch
    max_epochs = math.ceil(total_steps / steps_per_epoch)
    scheduler = accelerator.prepare(instantiate(cfg.scheduler)(optimizer, total_steps=total_steps))
    accelerator.init_trackers(cfg.project, config=flatten_config(OmegaConf.to_container(cfg)))
    watch_model(accelerator, model)  # W&B gradient/parameter histograms (tracker.wandb.watch)
    log.info(
        f"{sum(p.numel() for p in model.parameters()):,} parameters | "
        f"{total_steps} steps ({steps_per_epoch}/epoch) | world size {accelerator.num_processes} "
        f"({accelerator.distributed_type.value})"
    )

    # --- checkpoints: resume where an earlier run of this run dir stopped -------------
    book = MetricBook(cfg.trainer.monitor, cfg.trainer.monitor_mode)
    guard = LossGuard(cfg.trainer.on_nan, accelerator)  # NaN/inf loss: stop or skip
    ckpt = CheckpointManager(
        cfg,
        run_dir,
        accelerator,
        model,
        optimizer,
        scheduler,
        train_loader,
        stateful={"metrics": book},  # saved in trainer_state.json
        guard=guard,  # checked before every save: no checkpoint after a NaN
    )
    start_at = ckpt.resume()  # step/epoch/batch 0 unless resuming; restores every state
    step, epoch = start_at.step, start_at.epoch
    # -m hparams_search=optuna: this job's trial, told every evaluation (else a no-op)
    trial = TrialReporter.from_config(
        cfg.get("optuna_trial"), accelerator=accelerator, run_dir=run_dir
    )

    # --- preflight: devices, memory, disk, checkpoint round trip, speed and ETA -------
    # A failed check raises PreflightFailed (exit 1); the state is left as it was.
    run_preflight(cfg, run_dir, ckpt, train_loader, val_loader, compute_loss, total_steps, step)
    if cfg.preflight.only:  # preflight.only=true: the report was all we wanted
        accelerator.wait_for_everyone()
        accelerator.end_training()
        return None

    # --- the loop ----------------------------------------------------------------------
    progress = Progress(total_steps, initial_step=step)
    eval_every = cfg.trainer.eval_every_n_steps or steps_per_epoch
    log_every, clip_norm = cfg.trainer.log_every_n_steps, cfg.trainer.grad_clip_norm  # read once
    loss_sum = torch.zeros((), device=accelerator.device)  # summed on device: no sync per step
    loss_count = 0
    grad_norm = torch.zeros(())
    start = time.perf_counter()
    model.train()
    for epoch in range(start_at.epoch, max_epochs):
        if step == total_steps or ckpt.stop_requested:
            break
        train_loader.set_epoch(epoch)
        done = start_at.batch if epoch == start_at.epoch else 0  # batches a resumed run saw
        batches = skip_first_batches(train_loader, done) if done else train_loader
        for batch, (x, y) in enumerate(batches, start=done + 1):
            with accelerator.accumulate(model):
                loss = compute_loss(model, x, y)
                accelerator.backward(loss)
                guard.observe(loss)
                if accelerator.sync_gradients:
                    if clip_norm:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_norm)
                    if not guard.drop_update():  # on_nan=skip drops a non-finite update
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            loss_count += 1
            if not accelerator.sync_gradients:
                continue  # still accumulating micro-batches
            scheduler.step()
            step += 1
            progress.advance()

            if step % log_every == 0:
                rate = progress.window_rate(step)
                metrics = {
                    "train/loss": accelerator.reduce(loss_sum, "mean").item() / loss_count,
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/grad_norm": float(grad_norm),
                    "train/epoch": epoch + 1,
                    "perf/steps_per_sec": rate,
                    **throughput.metrics(rate, y, cfg.trainer.grad_accum_steps),
                }
                loss_sum.zero_()
                loss_count = 0
                book.update(metrics, step)
                accelerator.log(metrics, step=step)
                progress.report(step, metrics)
                guard.check(step)  # on_nan=stop: raise, naming the first bad step

            if step % eval_every == 0 or step == total_steps:
                metrics = evaluate(model, val_loader, accelerator)
                book.update(metrics, step, require_monitor=True)
                accelerator.log(metrics, step=step)
                progress.report(step, metrics)

            ckpt.maybe_save(step, epoch, batch)  # every N steps/epochs, new best, SIGTERM
            trial.report_and_check(step, book)  # Optuna pruning: raises TrialPruned (saved first)
            if step == total_steps or ckpt.stop_requested:
                break
    progress.close()
    guard.check(step)
    ckpt.finish()  # the last checkpoint; after a stop signal: exit (SLURM: requeue)

    # --- summary and final weights -----------------------------------------------------
    wall = time.perf_counter() - start
    summary = {
        "step": step,
        "epoch": epoch + 1,
        "world_size": accelerator.num_processes,
        "wall_time_s": round(wall, 3),
        "steps_per_sec": round((step - start_at.step) / wall, 3),  # this process's steps
        "metrics": book.last,
        "best": book.best(),
        "resumed_from": ckpt.resumed_from,  # null for a fresh start
        "skipped_nan_steps": guard.skipped,
    }
    write_summary(run_dir, summary)
    plain = accelerator.unwrap_model(model, keep_torch_compile=False)  # no DDP/compile wrapper
    log.info(f"final weights fingerprint {weights_fingerprint(plain)}")
    accelerator.save_model(plain, run_dir)  # final weights: model.safetensors
    log_final_model(accelerator, cfg, run_dir, loaders.val)  # MLflow: the model and weights
    log.info(
        f"done: {step} steps in {wall:.1f}s | "
        + " | ".join(f"{k} {v:.4f}" for k, v in book.last.items() if k.startswith("val/"))
        + f" | best {book.monitor} {book.best_value:.4f} at step {book.best_step}"
        + f" | summary: {run_dir / 'summary.json'}"
    )
    accelerator.wait_for_everyone()  # gloo can abort at exit without this barrier
    accelerator.end_training()
    return book.best_value


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    try:
        cfg = resolve_config(cfg)  # plain and resolved: no ${...}, no Hydra state needed
        check_config(cfg)
        run_dir = hydra_run_dir()
        save_resolved_config(cfg, run_dir)
        return run(train, cfg, run_dir)  # here, or in N spawned workers
    except (ConfigError, LaunchError, CheckpointError, NonFiniteLoss, PreflightFailed) as err:
        log.error(str(err))  # exit codes: 2 bad config, 1 failure, 3 NaN/inf loss
        if in_sweep():
            raise  # Hydra marks the job failed, runs the others, and the sweep exits 1
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
    register_resolvers()
    main()
