"""Preflight's probe: a checkpoint round trip around real, timed training steps.

The starting state is saved with the run's own checkpoint code, steps are timed
through the task's own ``training_step`` (its loss, the NaN guard, clipping), a
second save sizes a checkpoint, and loading the first puts the state back,
compared tensor for tensor. docs/preflight.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import resource
import shutil
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from .. import moments
from ..agreement import StepAgreement
from ..checkpoint import CheckpointError, CheckpointManager
from ..checkpoint import format as fmt
from ..nonfinite import LossGuard
from ..optimizers import inner_optimizers
from ..preemption import StopSignals
from ..schedules import steps_on_metric
from ..state import TrainState, rng_state
from ..step import Step
from .checks import Check, PreflightFailed, local_bytes, mib, sync


@dataclass
class Timing:
    """What the timed steps measured (on this rank)."""

    steps: int = 0  # optimizer steps timed
    step_s: float = 0.0  # seconds per optimizer step
    samples_per_step: float = 0.0  # all ranks
    samples: float = 0.0  # per optimizer step on this rank
    tokens: float | None = None  # per optimizer step on this rank (None: no positions)
    loader_s: float = 0.0  # loader alone, seconds per optimizer step's batches
    eval_s: float = 0.0  # one whole evaluation, scaled from a few batches
    peak_bytes: int | None = None
    peak_source: str = ""
    optimizer_bytes: int = 0  # after the steps (e.g. Adam allocates its state at the first)
    error: str = ""
    out_of_memory: bool = False


@dataclass
class RoundTrip:
    """The checkpoint round trip's result, and what was measured inside it."""

    check: Check
    timing: Timing
    checkpoint_bytes: int | None = None  # one checkpoint with optimizer state
    weights_bytes: int | None = None  # its model.safetensors
    save_s: float | None = None
    load_s: float = 0.0
    save_error: str = ""
    steps_per_sec: float | None = None  # set by check_speed
    eta_s: float | None = None
    eta_terms: dict[str, float] = field(default_factory=dict)  # what eta_s sums (check_speed)


def round_trip_and_timing(
    cfg: DictConfig,
    scratch: Path,
    acc: Any,
    state: TrainState,
    ckpt: CheckpointManager,
    start_step: int,
) -> RoundTrip:
    """Save the starting state (A), time real steps, save again (B: the size
    and cost of a checkpoint with optimizer state), load A back (restoring the
    run's state) and compare every tensor with the state before A. The scratch
    saves are synchronous even with checkpoint.async_save: the round trip reads them
    back at once (and the ETA counts a full save, an upper bound for async)."""
    world = acc.num_processes
    before = state_digests(acc, state)
    fresh_optimizer = _has_no_state(state.optimizer)
    try:
        restore_point = ckpt.scratch_save(scratch, start_step)
    except CheckpointError as err:
        if world > 1:
            raise PreflightFailed(f"preflight checkpoint: {err}") from err
        why = f"no restore point, so no steps were run: {err}"
        fail = Check("checkpoint", "fail", f"could not save the starting state: {err}")
        return RoundTrip(fail, Timing(error=why), save_error=str(err))

    moments.reached("preflight", start_step)  # the restore point saved; no timed step yet

    with _accumulation_phase_kept(acc):
        with _loaders_untouched(state.train_loader, state.val_loader):
            timing = _time_steps(cfg, acc, state)
        result = RoundTrip(Check("checkpoint", "pass", ""), timing)
        try:
            started = time.perf_counter()
            sized = ckpt.scratch_save(scratch, start_step + 1)
            result.save_s = time.perf_counter() - started
            files = [p for p in sized.rglob("*") if p.is_file()]  # sharded: model/, optimizer/
            result.checkpoint_bytes = sum(p.stat().st_size for p in files)
            result.weights_bytes = sum(  # model.safetensors, or the model/ shards
                p.stat().st_size for p in files if p.name == fmt.MODEL or p.parent.name == "model"
            )
        except CheckpointError as err:
            if world > 1:
                raise PreflightFailed(f"preflight checkpoint: {err}") from err
            result.save_error = str(err)
        try:
            started = time.perf_counter()
            ckpt.load(restore_point)
            result.load_s = time.perf_counter() - started
            if fresh_optimizer:
                _forget_optimizer_state(state.optimizer)
        except CheckpointError as err:
            if world > 1:
                raise PreflightFailed(
                    f"preflight checkpoint: could not load it back: {err}"
                ) from err
            result.check = Check(
                "checkpoint", "fail", f"saved, but loading it back failed: {err}", _ROUND_TRIP_FIX
            )
            return result
        finally:
            state.optimizer.zero_grad(set_to_none=True)
    after = state_digests(acc, state)
    differ = [k for k in before if before[k] != after.get(k)] + [
        k for k in after if k not in before
    ]
    if differ:
        shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        result.check = Check(
            "checkpoint",
            "fail",
            f"{len(differ)} of {len(before)} state entries differ after save -> load: {shown}",
            _ROUND_TRIP_FIX,
        )
        return result

    def tensors(part: str) -> int:
        return sum(k.startswith(part + ".") and v.startswith("torch.") for k, v in before.items())

    size = mib(result.checkpoint_bytes) if result.checkpoint_bytes else "size unknown"
    cost = f", save {result.save_s:.2f} s" if result.save_s is not None else ""
    result.check = Check(
        "checkpoint",
        "pass",
        f"the starting state saved and loaded back with the checkpoint code: all {len(before)} "
        f"entries equal bit for bit ({tensors('model')} model tensors, "
        f"{tensors('optimizer')} optimizer tensors, schedule, RNGs, metrics); "
        f"{size} per checkpoint with optimizer state{cost}, load {result.load_s:.2f} s",
    )
    return result


_ROUND_TRIP_FIX = (
    "make state_dict()/load_state_dict() of the model (and optimizer) restore the full "
    "state; otherwise a resumed run silently continues from a different one"
)


def state_digests(acc: Any, state: TrainState) -> dict[str, str]:
    """sha256 of every tensor and value of the training state, by name: what a
    checkpoint must restore. Local shards under FSDP and ZeRO-3; no collectives."""
    scaler = getattr(acc, "scaler", None)
    tree = {
        "model": _local_model_state(state.model),
        "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else {},
        "rng": rng_state(),
        "stateful": {name: obj.state_dict() for name, obj in state.stateful.items()},
    }
    digests: dict[str, str] = {}
    _digest_into(digests, tree, "")
    return digests


def _local_model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state as this rank holds it: a ZeRO-3 parameter by its own
    partition (``ds_tensor``), since whether its full tensor happens to be
    gathered at the moment (e.g. after DeepSpeed's load) is not what it holds."""
    out: dict[str, Any] = dict(model.state_dict())
    for name, param in model.named_parameters(remove_duplicate=False):  # tied: each name
        if hasattr(param, "ds_tensor"):
            out[name] = param.ds_tensor
    return out


def _digest_into(out: dict[str, str], tree: Any, prefix: str) -> None:
    if isinstance(tree, dict):
        for key, value in tree.items():
            _digest_into(out, value, f"{prefix}{key}.")
    elif isinstance(tree, list | tuple) and any(isinstance(v, torch.Tensor | dict) for v in tree):
        for i, value in enumerate(tree):
            _digest_into(out, value, f"{prefix}{i}.")
    elif isinstance(tree, list | tuple):
        out[prefix.rstrip(".")] = repr(list(tree))  # a saved tuple may load as a list
    elif isinstance(tree, torch.Tensor):
        tensor = tree.to_local() if hasattr(tree, "to_local") else tree  # a DTensor shard
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest = hashlib.sha256(data.tobytes()).hexdigest()
        out[prefix.rstrip(".")] = f"{tensor.dtype}{tuple(tensor.shape)}:{digest}"
    else:
        out[prefix.rstrip(".")] = repr(tree)


def _time_steps(cfg: DictConfig, acc: Any, state: TrainState) -> Timing:
    """Warm-up steps, then timed steps, the loader alone, and a few evaluation
    batches. Real optimizer steps, as the training loop takes them (with a
    loss guard of their own: the run's sees only the run's steps)."""
    model, train_loader, val_loader = state.model, state.train_loader, state.val_loader
    guard = StepAgreement(
        accelerator=acc,
        guard=LossGuard(cfg.trainer.on_nan, acc),
        signals=StopSignals(enabled=False),
        every_n_steps=cfg.trainer.log_every_n_steps,
    )
    step = Step(
        accelerator=acc,
        agreement=guard,
        clip_norm=cfg.trainer.grad_clip_norm,
        models=state.step.models,
        optimizer=state.step.all_optimizers,
        frozen=state.step.frozen,
    )
    pf, trainer = cfg.preflight, cfg.trainer
    timing = Timing()
    device = acc.device
    cuda = device.type == "cuda"
    batches = _cycle(train_loader)
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        model.train()
        for _ in range(pf.warmup_steps):
            _train_step(state, step, batches)
        sync(device)
        counts = [0, 0]  # samples, tokens
        started = time.perf_counter()
        each = []  # seconds of every timed step
        for _ in range(pf.timed_steps):
            _add(counts, _train_step(state, step, batches))
            sync(device)
            each.append(time.perf_counter() - started - sum(each))
        # More steps while they took under min_timed_seconds and their times
        # still scatter: a tiny model's few milliseconds would measure the OS
        # scheduler, not the step. Steady times are estimate enough (preflight's
        # cost stays small, the template's bench/README.md). Every rank takes the same
        # number (each step holds collectives), so every rank asks the others,
        # also one whose own steps took long enough: the ranks' clocks differ, and
        # a rank that skipped this collective would hang the others in it.
        steps, elapsed = pf.timed_steps, time.perf_counter() - started
        more = 0
        if elapsed < pf.min_timed_seconds and not _steady(each):
            more = math.ceil(pf.min_timed_seconds * steps / max(elapsed, 1e-9)) - steps
        more = min(_max_over_ranks(acc, more), 100 * steps)
        if more:
            for _ in range(more):
                _add(counts, _train_step(state, step, batches))
            steps += more
            sync(device)
        timing.steps = steps
        timing.step_s = (time.perf_counter() - started) / steps
        samples, tokens = counts
        timing.samples_per_step = samples * acc.num_processes / steps
        timing.samples = samples / steps
        timing.tokens = tokens / steps if tokens else None
        timing.optimizer_bytes = local_bytes(
            v for s in state.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
        )
        if cuda:
            timing.peak_bytes = torch.cuda.max_memory_allocated(device)
            timing.peak_source = "CUDA allocator, warm-up and timed steps"
        else:
            timing.peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            timing.peak_source = "peak RSS of the process: a CPU has no allocator statistics"

        # The loader alone: the same number of batches, no compute.
        micro = pf.timed_steps * trainer.grad_accum_steps
        started = time.perf_counter()
        for _ in range(micro):
            next(batches)
        sync(device)
        timing.loader_s = (time.perf_counter() - started) / pf.timed_steps

        # Evaluation: a few batches forward, scaled to the whole validation set.
        n_eval = min(pf.eval_batches, len(val_loader))
        if n_eval:
            model.eval()
            with torch.no_grad():
                val_batches = _cycle(val_loader)
                started = time.perf_counter()
                for _ in range(n_eval):
                    model(state.task.inputs(batch=next(val_batches)))
                sync(device)
            timing.eval_s = (time.perf_counter() - started) / n_eval * len(val_loader)
            model.train()
    except Exception as err:  # out of memory, or the step itself is broken
        timing.out_of_memory = isinstance(err, torch.cuda.OutOfMemoryError)
        timing.error = (
            f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        )
        timing.step_s = 0.0
        if acc.num_processes > 1:
            raise PreflightFailed(f"preflight: a training step failed: {timing.error}") from err
    finally:
        state.optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()
    return timing


def _train_step(state: TrainState, step: Step, batches: Iterator) -> tuple[int, int]:
    """One optimizer step (all its micro-batches) through the task's own
    ``training_step``, as the loop takes it; returns the samples and tokens used
    (the task counts them)."""
    samples = tokens = 0
    while True:
        batch = next(batches)
        counted = state.task.batch_size(batch=batch)
        samples, tokens = samples + counted[0], tokens + (counted[1] or 0)
        state.task.training_step(step=step, batch=batch)
        if step.update_done():
            break
    if not steps_on_metric(state.scheduler):  # ReduceLROnPlateau steps on evaluations
        state.scheduler.step()
    return samples, tokens


def _steady(seconds: list[float]) -> bool:
    """The step times agree: the later half's median within 10 % of the
    earlier half's, and no step more than twice the median."""
    if len(seconds) < 4:
        return False
    half = len(seconds) // 2
    early, late = statistics.median(seconds[:half]), statistics.median(seconds[half:])
    middle = statistics.median(seconds)
    return abs(late - early) <= 0.1 * middle and max(seconds) <= 2 * middle


def _add(counts: list[int], counted: tuple[int, int]) -> None:
    counts[0] += counted[0]
    counts[1] += counted[1]


def _max_over_ranks(acc: Any, value: int) -> int:
    if acc.num_processes == 1:
        return value
    return int(acc.gather(torch.tensor([value], device=acc.device)).max())


def _cycle(loader: Any) -> Iterator:
    while True:
        yield from loader


@contextlib.contextmanager
def _loaders_untouched(*loaders: Any) -> Iterator[None]:
    """Iterating a loader draws from its generator (the workers' base seed) and
    registers it with accelerate's gradient state; put both back, so the
    training loop sees the loaders as preflight found them."""
    saved = []
    for loader in loaders:
        gen = getattr(loader, "generator", None)
        saved.append(
            (gen, gen.get_state() if gen is not None else None, getattr(loader, "iteration", None))
        )
    try:
        yield
    finally:
        for loader, (gen, state, iteration) in zip(loaders, saved, strict=True):
            if gen is not None:
                gen.set_state(state)
            if iteration is not None:
                loader.iteration = iteration
            if hasattr(loader, "end"):
                loader.end()  # an abandoned iteration never ends itself


# --- what has no public API: each in one small function -----------------------------


def _has_no_state(optimizer: Any) -> bool:
    return not getattr(optimizer, "optimizer", optimizer).state  # accelerate wraps it


def _forget_optimizer_state(optimizer: Any) -> None:
    """After restoring a fresh optimizer: nothing to restore, but under FSDP
    loading initializes the state with a fake step (step 1, zero moments). No
    public API empties it, so clear ``optimizer.state`` (load_state_dict put a
    new dict there)."""
    inner = inner_optimizers(optimizer)  # one, or each of several (optimizers.py)
    for each in inner if isinstance(inner, list) else [inner]:
        each.state.clear()


@contextlib.contextmanager
def _accumulation_phase_kept(acc: Any) -> Iterator[None]:
    """accelerate counts micro-batches in ``Accelerator.step`` (it decides
    ``sync_gradients``, and resets at a loader's end); that counter is in no
    checkpoint and has no public setter, so the timed steps put it back here."""
    step = acc.step
    try:
        yield
    finally:
        acc.step = step


@contextlib.contextmanager
def scratch_dir(path: Path, acc: Any) -> Iterator[None]:
    """``path`` empty on entry, gone on exit (the main process acts; all wait).
    No barrier on an error: the other ranks may be inside another collective."""
    if acc.is_main_process:
        shutil.rmtree(path, ignore_errors=True)
    acc.wait_for_everyone()
    try:
        yield
        acc.wait_for_everyone()
    finally:
        if acc.is_main_process:
            shutil.rmtree(path, ignore_errors=True)
