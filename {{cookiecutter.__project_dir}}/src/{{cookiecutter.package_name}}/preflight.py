"""Preflight: check the machine and the run before hours of training (``configs/preflight/``).

``train.py`` calls ``run_preflight`` on every rank after the model, optimizer
and loaders are prepared (and a resume restored them), before the first step.
``python train.py preflight.only=true`` runs it alone: it prints the report
and exits 0 (every check pass or warn) or 1 (any fail), training nothing.
A fail stops every run, with the reason and the fix. The checks:

- devices: count, names, total and free memory (GPUs; CPU cores and RAM on a
  CPU); the world size against the devices (one GPU, or at least one CPU core,
  per process); bf16 support for ``trainer.mixed_precision=bf16``;
- memory: parameter, gradient and optimizer-state bytes; the measured peak of
  real training steps (CUDA allocator; on a CPU the process's peak RSS);
- disk: free space at the checkpoint dir against the size of one real
  checkpoint x (``keep_last`` + best + one in flight), and a write, fsync and
  read-back test there;
- checkpoint: the round trip: the state the run starts from is saved with the
  real checkpoint code, loaded back, and every tensor compared;
- speed: steps/s and samples/s of a few timed steps after a warm-up, the ETA
  of the configured run with its evaluations and checkpoint saves, the share
  of a step the data loader alone takes, and the MFU where known (``flops.py``);
- distributed: an all-reduce across every rank, checked and timed;
- trackers: packages importable, offline or online, credentials where needed.

The timed steps are real steps: they change the weights, optimizer, schedule
and RNGs. The checkpoint round trip puts all of that back (its load is the
restore), so a run trains exactly as it would without preflight. The scratch
checkpoints live in ``<run dir>/.preflight/`` and are removed at the end.

Output: a table in the log (console and ``train.log``) and ``preflight.json``
in the run dir: ``{"checks": [{"name", "status", "detail"}], "estimates":
{"steps_per_sec", "eta_s", "checkpoint_bytes", "disk_free_bytes",
"peak_memory_bytes"}}``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib.util
import io
import logging
import math
import netrc
import os
import resource
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from omegaconf import DictConfig, OmegaConf

from .checkpoint import CheckpointError, CheckpointManager, rng_state
from .flops import MFU
from .run_dir import write_json_atomic

log = logging.getLogger(__name__)

STATUSES = ("pass", "warn", "fail")
SCRATCH = ".preflight"  # in the run dir: on the checkpoints' filesystem
# Tracker name -> the package it needs (csv needs none).
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class PreflightFailed(RuntimeError):
    """A preflight check failed; the run stops before training (exit code 1)."""

    exit_code = 1


@dataclass
class Check:
    name: str
    status: str  # pass | warn | fail
    detail: str
    fix: str = ""


@dataclass
class Timing:
    """What the timed steps measured (on this rank)."""

    steps: int = 0  # optimizer steps timed
    step_s: float = 0.0  # seconds per optimizer step
    samples_per_step: float = 0.0  # all ranks
    loader_s: float = 0.0  # loader alone, seconds per optimizer step's batches
    eval_s: float = 0.0  # one whole evaluation, scaled from a few batches
    peak_bytes: int | None = None
    peak_source: str = ""
    optimizer_bytes: int = 0  # after the steps (e.g. Adam allocates its state at the first)
    error: str = ""
    out_of_memory: bool = False


# --- the entry point -------------------------------------------------------------------


def run_preflight(
    cfg: DictConfig,
    run_dir: Path,
    ckpt: CheckpointManager,
    train_loader: Any,
    val_loader: Any,
    loss_fn: Callable[[torch.nn.Module, Any, Any], torch.Tensor],
    total_steps: int,
    start_step: int,
) -> dict[str, Any] | None:
    """Run every check on every rank, report on the main process, and raise
    PreflightFailed (on every rank) when any check failed. Returns the report
    (``preflight.json``'s content), or None with ``preflight.enabled=false``.

    ``ckpt`` is the run's CheckpointManager: its model, optimizer, scheduler and
    stateful objects are what preflight times and restores. ``loss_fn(model, x,
    y)`` is the loss of one micro-batch, as in the training loop."""
    pf = cfg.preflight
    if not pf.enabled:
        return None
    acc = ckpt.accelerator
    started = time.perf_counter()
    world = acc.num_processes

    checks = [_guard("devices", world, lambda: check_devices(cfg, acc))]
    free = shutil.disk_usage(run_dir).free if acc.is_main_process else None
    scratch = run_dir / SCRATCH
    with _scratch_dir(scratch, acc), _quiet(logging.getLogger(CheckpointManager.__module__)):
        rt = _round_trip_and_timing(
            cfg, scratch, ckpt, train_loader, val_loader, loss_fn, start_step
        )
        checks.append(_guard("memory", world, lambda: check_memory(cfg, ckpt, rt.timing)))
        checks.append(rt.check)
        checks.append(
            _guard("disk", world, lambda: check_disk(cfg, run_dir, free, rt))
            if acc.is_main_process
            else Check("disk", "pass", "checked by the main process")
        )
    speed = _guard("speed", world, lambda: check_speed(cfg, ckpt, rt, total_steps, start_step))
    checks.append(speed)
    checks.append(_guard("distributed", world, lambda: check_distributed(ckpt)))
    checks.append(_guard("trackers", world, lambda: check_trackers(cfg)))
    estimates = {
        "steps_per_sec": rt.steps_per_sec,
        "eta_s": rt.eta_s,
        "checkpoint_bytes": rt.checkpoint_bytes,
        "disk_free_bytes": free,
        "peak_memory_bytes": rt.timing.peak_bytes,
    }

    # Every rank ran the same checks: the worst status of each, on every rank.
    merged = _merge(gather_object([checks]))
    report = {
        "checks": [{"name": c.name, "status": c.status, "detail": _with_fix(c)} for c in merged],
        "estimates": estimates,
    }
    if acc.is_main_process:
        write_json_atomic(run_dir / "preflight.json", report)
        took = time.perf_counter() - started
        log.info(
            f"preflight ({took:.1f} s), also in {run_dir / 'preflight.json'}:\n" + _table(report)
        )
    failed = [c for c in merged if c.status == "fail"]
    if failed:
        raise PreflightFailed(
            "preflight failed, nothing trained:\n  "
            + "\n  ".join(f"{c.name}: {_with_fix(c)}" for c in failed)
        )
    return report


def _guard(name: str, world: int, fn: Callable[[], Check]) -> Check:
    """A check's unexpected error is its failure. With several processes it is
    raised instead: the other ranks may be inside a collective this rank left,
    so the run stops (the launcher reports this rank's error)."""
    try:
        return fn()
    except Exception as err:
        if world > 1:
            raise PreflightFailed(f"preflight {name}: {type(err).__name__}: {err}") from err
        return Check(name, "fail", f"{type(err).__name__}: {err}")


def _merge(per_rank: list[list[Check]]) -> list[Check]:
    """One row per check: the worst status over the ranks, with that rank's
    detail (rank 0's when they agree)."""
    merged = []
    for i, first in enumerate(per_rank[0]):
        rows = [checks[i] for checks in per_rank]
        worst = max(rows, key=lambda c: STATUSES.index(c.status))
        rank = rows.index(worst)
        if rank and worst.status != first.status:
            worst = Check(worst.name, worst.status, f"rank {rank}: {worst.detail}", worst.fix)
        merged.append(worst)
    return merged


def _with_fix(check: Check) -> str:
    return (
        f"{check.detail}. Fix: {check.fix}"
        if check.fix and check.status != "pass"
        else check.detail
    )


# --- devices ---------------------------------------------------------------------------


def _device_facts(acc: Any) -> dict[str, Any]:
    device = acc.device
    facts: dict[str, Any] = {"rank": acc.process_index, "host": socket.gethostname()}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        props = torch.cuda.get_device_properties(device)
        facts |= {
            "kind": "cuda",
            "name": props.name,
            "id": str(getattr(props, "uuid", device.index)),
            "total": total,
            "free": free,
            "visible": torch.cuda.device_count(),
            "bf16": torch.cuda.is_bf16_supported(),
        }
    else:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        total, free = _ram()
        facts |= {
            "kind": device.type,
            "name": "CPU",
            "cores": cores if cores is not None else list(range(os.cpu_count() or 1)),
            "total": total,
            "free": free,
            "bf16": True,  # CPU autocast supports bf16
        }
    return facts


def _ram() -> tuple[int, int]:
    """(total, available) bytes of RAM."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    available = os.sysconf("SC_AVPHYS_PAGES") * page
    with contextlib.suppress(OSError, ValueError, StopIteration):
        lines = Path("/proc/meminfo").read_text().splitlines()
        available = int(next(x for x in lines if x.startswith("MemAvailable:")).split()[1]) * 1024
    return total, available


def check_devices(cfg: DictConfig, acc: Any) -> Check:
    facts: list[dict[str, Any]] = gather_object([_device_facts(acc)])
    world = len(facts)
    hosts: dict[str, list[dict[str, Any]]] = {}
    for f in facts:
        hosts.setdefault(f["host"], []).append(f)
    problems, fixes, warnings, parts = [], [], [], []
    for host, ranks in hosts.items():
        where = f" on {host}" if len(hosts) > 1 else ""
        first = ranks[0]
        if first["kind"] == "cuda":
            names = sorted({r["name"] for r in ranks})
            parts.append(
                f"{len(ranks)} x {'/'.join(names)}{where}: "
                f"{_gib(min(r['total'] for r in ranks))} each, "
                f"free {_gib(min(r['free'] for r in ranks))} or more"
            )
            ids = [r["id"] for r in ranks]
            if len(set(ids)) < len(ids):
                shared = sorted({r["rank"] for r in ranks if ids.count(r["id"]) > 1})
                problems.append(
                    f"ranks {', '.join(map(str, shared))}{where} share a GPU: "
                    f"{len(ranks)} processes, {len(set(ids))} GPUs"
                )
                fixes.append(f"one process per GPU: parallel.num_processes <= {first['visible']}")
            elif len(ranks) < first["visible"]:
                warnings.append(f"{first['visible'] - len(ranks)} of {first['visible']} GPUs idle")
        else:
            cores = set().union(*(r["cores"] for r in ranks))
            parts.append(
                f"{len(ranks)} process(es) on {len(cores)} CPU core(s){where}, "
                f"RAM {_gib(first['total'])} ({_gib(first['free'])} available)"
            )
            if len(ranks) > len(cores):
                problems.append(
                    f"{len(ranks)} processes{where} share {len(cores)} CPU core(s): "
                    "the world size needs a core per process"
                )
                fixes.append(
                    f"at most {len(cores)} process(es) here (parallel.num_processes, or "
                    "parallel.cpu_processes with num_processes=auto), or give the job more "
                    "cores (e.g. SLURM --cpus-per-task)"
                )
    precision = cfg.trainer.mixed_precision or "no"
    no_bf16 = sorted({f["name"] for f in facts if not f["bf16"]})
    if precision == "bf16" and no_bf16:
        problems.append(f"trainer.mixed_precision=bf16, but {', '.join(no_bf16)} has no bf16")
        fixes.append("trainer.mixed_precision=fp16 (or no)")
    detail = f"world size {world}: " + "; ".join(parts) + f"; mixed precision {precision}"
    if problems:
        return Check("devices", "fail", detail + "; " + "; ".join(problems), "; ".join(fixes))
    if warnings:
        return Check("devices", "warn", detail + "; " + "; ".join(warnings), "parallel=ddp")
    return Check("devices", "pass", detail)


# --- checkpoint round trip, timed steps ----------------------------------------------


@dataclass
class RoundTrip:
    """The checkpoint round trip's result, and what was measured inside it."""

    check: Check
    timing: Timing
    checkpoint_bytes: int | None = None  # one checkpoint with optimizer state
    weights_bytes: int | None = None  # its model.safetensors
    save_s: float | None = None
    save_error: str = ""
    steps_per_sec: float | None = None  # set by check_speed
    eta_s: float | None = None


def _round_trip_and_timing(
    cfg: DictConfig,
    scratch: Path,
    ckpt: CheckpointManager,
    train_loader: Any,
    val_loader: Any,
    loss_fn: Callable,
    start_step: int,
) -> RoundTrip:
    """Save the starting state (A), time real steps, save again (B: the size
    and cost of a checkpoint with optimizer state), load A back (restoring the
    run's state) and compare every tensor with the state before A."""
    acc = ckpt.accelerator
    world = acc.num_processes
    timing = Timing()
    if cfg.parallel.mode == "deepspeed":
        why = "not run under DeepSpeed: its state cannot be saved and restored safely"
        return RoundTrip(Check("checkpoint", "warn", why), Timing(error=why))
    config = OmegaConf.to_container(cfg, resolve=True)
    # Synchronous scratch saves even with checkpoint.async: the round trip reads them
    # back at once (and the ETA counts a full save, an upper bound for async runs).
    config["checkpoint"] = {
        **config["checkpoint"],
        "enabled": True,
        "save_on_signal": False,
        "async": False,
    }
    temp = CheckpointManager(
        OmegaConf.create(config),
        scratch,
        acc,
        ckpt.model,
        ckpt.optimizer,
        ckpt.scheduler,
        train_loader,
        stateful=ckpt.stateful,
        guard=ckpt.guard,
    )
    before = state_digests(ckpt)
    inner_optimizer = getattr(ckpt.optimizer, "optimizer", ckpt.optimizer)  # accelerate wraps it
    fresh_optimizer = not inner_optimizer.state
    try:
        restore_point = temp.save(start_step, 0, 0, ["preflight"])
    except CheckpointError as err:
        if world > 1:
            raise PreflightFailed(f"preflight checkpoint: {err}") from err
        why = f"no restore point, so no steps were run: {err}"
        fail = Check("checkpoint", "fail", f"could not save the starting state: {err}")
        return RoundTrip(fail, Timing(error=why), save_error=str(err))

    accumulation_step = acc.step
    with _loaders_untouched(train_loader, val_loader):
        timing = _time_steps(cfg, ckpt, train_loader, val_loader, loss_fn)
    result = RoundTrip(Check("checkpoint", "pass", ""), timing)
    try:
        started = time.perf_counter()
        sized = temp.save(start_step + 1, 0, 0, ["preflight"])
        result.save_s = time.perf_counter() - started
        result.checkpoint_bytes = sum(p.stat().st_size for p in sized.iterdir())
        result.weights_bytes = (sized / "model.safetensors").stat().st_size
    except CheckpointError as err:
        if world > 1:
            raise PreflightFailed(f"preflight checkpoint: {err}") from err
        result.save_error = str(err)
    try:
        started = time.perf_counter()
        temp.load(restore_point)
        load_s = time.perf_counter() - started
        if fresh_optimizer:
            # Nothing to restore: a fresh optimizer has no state. (Under FSDP,
            # loading initializes one with a fake step: step 1, zero moments.)
            inner_optimizer.state.clear()  # (load_state_dict put a new dict there)
    except CheckpointError as err:
        if world > 1:
            raise PreflightFailed(f"preflight checkpoint: could not load it back: {err}") from err
        result.check = Check(
            "checkpoint", "fail", f"saved, but loading it back failed: {err}", _ROUND_TRIP_FIX
        )
        return result
    finally:
        acc.step = accumulation_step
        ckpt.optimizer.zero_grad(set_to_none=True)
    after = state_digests(ckpt)
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

    size = _mib(result.checkpoint_bytes) if result.checkpoint_bytes else "size unknown"
    cost = f", save {result.save_s:.2f} s" if result.save_s is not None else ""
    result.check = Check(
        "checkpoint",
        "pass",
        f"the starting state saved and loaded back with checkpoint.py: all {len(before)} "
        f"entries equal bit for bit ({tensors('model')} model tensors, "
        f"{tensors('optimizer')} optimizer tensors, schedule, RNGs, metrics); "
        f"{size} per checkpoint with optimizer state{cost}, load {load_s:.2f} s",
    )
    return result


_ROUND_TRIP_FIX = (
    "make state_dict()/load_state_dict() of the model (and optimizer) restore the full "
    "state; otherwise a resumed run silently continues from a different one"
)


def state_digests(ckpt: CheckpointManager) -> dict[str, str]:
    """sha256 of every tensor and value of the training state, by name: what a
    checkpoint must restore. Local shards under FSDP; no collectives."""
    scaler = getattr(ckpt.accelerator, "scaler", None)
    state = {
        "model": ckpt.model.state_dict(),
        "optimizer": ckpt.optimizer.state_dict(),
        "scheduler": ckpt.scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else {},
        "rng": rng_state(),
        "stateful": {name: obj.state_dict() for name, obj in ckpt.stateful.items()},
    }
    digests: dict[str, str] = {}
    _digest_into(digests, state, "")
    return digests


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


def _time_steps(
    cfg: DictConfig, ckpt: CheckpointManager, train_loader: Any, val_loader: Any, loss_fn: Callable
) -> Timing:
    """Warm-up steps, then timed steps, the loader alone, and a few evaluation
    batches. Real optimizer steps, as the training loop takes them."""
    acc, model = ckpt.accelerator, ckpt.model
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
            _train_step(acc, ckpt, batches, loss_fn, trainer.grad_clip_norm)
        _sync(device)
        samples = 0
        started = time.perf_counter()
        for _ in range(pf.timed_steps):
            samples += _train_step(acc, ckpt, batches, loss_fn, trainer.grad_clip_norm)
        _sync(device)
        # More steps while they took under min_timed_seconds: a tiny model's few
        # milliseconds would measure the OS scheduler, not the step. Every rank
        # takes the same number (each step holds collectives).
        steps, elapsed = pf.timed_steps, time.perf_counter() - started
        if elapsed < pf.min_timed_seconds:
            more = math.ceil(pf.min_timed_seconds * steps / max(elapsed, 1e-9)) - steps
            more = min(_max_over_ranks(acc, more), 100 * steps)
            for _ in range(more):
                samples += _train_step(acc, ckpt, batches, loss_fn, trainer.grad_clip_norm)
            steps += more
            _sync(device)
        timing.steps = steps
        timing.step_s = (time.perf_counter() - started) / steps
        timing.samples_per_step = samples * acc.num_processes / steps
        timing.optimizer_bytes = _local_bytes(
            v for s in ckpt.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
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
        _sync(device)
        timing.loader_s = (time.perf_counter() - started) / pf.timed_steps

        # Evaluation: a few batches forward, scaled to the whole validation set.
        n_eval = min(pf.eval_batches, len(val_loader))
        if n_eval:
            model.eval()
            with torch.no_grad():
                val_batches = _cycle(val_loader)
                started = time.perf_counter()
                for _ in range(n_eval):
                    x, _y = next(val_batches)
                    model(x)
                _sync(device)
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
        ckpt.optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()
    return timing


def _train_step(
    acc: Any,
    ckpt: CheckpointManager,
    batches: Iterator,
    loss_fn: Callable,
    clip: float | None,
) -> int:
    """One optimizer step (all its micro-batches); returns the samples used."""
    model, optimizer = ckpt.model, ckpt.optimizer
    samples = 0
    while True:
        x, y = next(batches)
        samples += len(y)
        with acc.accumulate(model):
            loss = loss_fn(model, x, y)
            acc.backward(loss)
            if acc.sync_gradients:
                if clip:
                    acc.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                break
    ckpt.scheduler.step()
    return samples


def _max_over_ranks(acc: Any, value: int) -> int:
    if acc.num_processes == 1:
        return value
    return int(acc.gather(torch.tensor([value], device=acc.device)).max())


def _cycle(loader: Any) -> Iterator:
    while True:
        yield from loader


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


@contextlib.contextmanager
def _scratch_dir(path: Path, acc: Any) -> Iterator[None]:
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


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """No "checkpoint saved" lines for the scratch checkpoints."""
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


# --- memory, disk, speed ---------------------------------------------------------------


def _local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def check_memory(cfg: DictConfig, ckpt: CheckpointManager, timing: Timing) -> Check:
    params = list(ckpt.model.parameters())
    param_bytes = _local_bytes(params)
    grad_bytes = _local_bytes(p for p in params if p.requires_grad)
    sizes = (
        f"parameters {_mib(param_bytes)}, gradients {_mib(grad_bytes)}, "
        f"optimizer state {_mib(timing.optimizer_bytes)} per rank"
    )
    if timing.out_of_memory:
        return Check(
            "memory",
            "fail",
            f"{sizes}; out of memory in a training step: {timing.error}",
            "lower data.batch_size (raise trainer.grad_accum_steps to keep the batch), "
            "use trainer.mixed_precision=bf16, or parallel=fsdp",
        )
    if timing.peak_bytes is None:
        return Check("memory", "warn", f"{sizes}; peak not measured: {timing.error}")
    device = ckpt.accelerator.device
    warn_at = cfg.preflight.memory_warn_fraction
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        share = timing.peak_bytes / total
        detail = (
            f"{sizes}; peak {_mib(timing.peak_bytes)} of {_mib(total)} ({share:.0%}; "
            f"{timing.peak_source})"
        )
    else:
        total, _ = _ram()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        share = timing.peak_bytes * local / total
        detail = (
            f"{sizes}; peak {_mib(timing.peak_bytes)} per process, {local} on this node: "
            f"{share:.0%} of {_mib(total)} RAM ({timing.peak_source})"
        )
    if share > warn_at:
        return Check(
            "memory",
            "warn",
            f"{detail}: above preflight.memory_warn_fraction={warn_at}",
            "lower data.batch_size or use trainer.mixed_precision=bf16",
        )
    return Check("memory", "pass", detail)


def check_disk(cfg: DictConfig, run_dir: Path, free: int, rt: RoundTrip) -> Check:
    """Main process only: free space against the checkpoints kept, and a write test."""
    where = run_dir / "checkpoints"
    ck = cfg.checkpoint
    checkpoint_bytes = rt.checkpoint_bytes
    if checkpoint_bytes is None:
        return Check(
            "disk",
            "fail",
            f"{_mib(free)} free at {where}; could not write one checkpoint to size it: "
            f"{rt.save_error or rt.timing.error}",
            "free disk space or put the run dir on a larger disk (hydra.run.dir=...)",
        )
    if ck.enabled:
        best = 1 if (ck.get("save_best") or {}).get("enabled", False) else 0
        count = max(2, ck.keep_last) + best + 1
        what = (
            f"{count} checkpoints of {_mib(checkpoint_bytes)} (keep_last {max(2, ck.keep_last)}"
            f"{' + best' if best else ''} + 1 in flight)"
        )
        need = count * checkpoint_bytes
    else:
        what, need = "the final weights (checkpoints are off)", rt.weights_bytes or 0
    written = _write_test(run_dir / SCRATCH, min(cfg.preflight.disk_test_mib * 2**20, free // 4))
    if written.startswith("error"):
        return Check(
            "disk",
            "fail",
            f"{_mib(free)} free at {where}; the write test failed: {written}",
            "free disk space or fix the permissions of the run dir",
        )
    detail = f"{_mib(free)} free at {where}, {what} need {_mib(need)}; {written}"
    if need > free:
        return Check(
            "disk",
            "fail",
            f"not enough disk space: {detail}",
            "free disk space, put the run dir on a larger disk (hydra.run.dir=...), or "
            "lower checkpoint.keep_last",
        )
    return Check("disk", "pass", detail)


def _write_test(directory: Path, size: int) -> str:
    """Write ``size`` bytes, fsync, read back, compare, remove. Returns a
    description of the speed; on an OSError, a string starting with "error"."""
    path = directory / "write_test.bin"
    size = max(size, 1)
    block = os.urandom(min(size, 2**20))
    try:
        started = time.perf_counter()
        digest = hashlib.sha256()
        with open(path, "wb") as f:
            written = 0
            while written < size:
                chunk = block[: size - written]
                f.write(chunk)
                digest.update(chunk)
                written += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        took = time.perf_counter() - started
        back = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as err:
        return f"error {err.strerror or err} ({err.filename or directory})"
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    if back != digest.hexdigest():
        return "error: the bytes read back differ from the bytes written"
    return (
        f"write + fsync + read-back of {_mib(size)} ok ({size / max(took, 1e-9) / 2**20:.0f} MiB/s)"
    )


def _count_events(cfg: DictConfig, total_steps: int, start_step: int, steps_per_epoch: int):
    """Steps in (start_step, total_steps] that evaluate, and that may save."""
    if start_step >= total_steps:
        return set(), set()  # a finished run resumed: nothing left to do

    def multiples(k: int | None) -> set[int]:
        if not k:
            return set()
        return set(range((start_step // k + 1) * k, total_steps + 1, k))

    evals = multiples(cfg.trainer.eval_every_n_steps or steps_per_epoch) | {total_steps}
    ck = cfg.checkpoint
    saves: set[int] = set()
    if ck.enabled:
        saves |= multiples(ck.get("every_n_steps"))
        if ck.get("every_n_epochs"):
            saves |= multiples(ck.every_n_epochs * steps_per_epoch)
        if (ck.get("save_best") or {}).get("enabled", False):
            saves |= evals  # at most: every evaluation a new best
        if ck.get("save_last", True):
            saves.add(total_steps)
    return evals, saves


def check_speed(
    cfg: DictConfig, ckpt: CheckpointManager, rt: RoundTrip, total_steps: int, start_step: int
) -> Check:
    """steps/s, samples/s, MFU and the ETA (stored in ``rt``); the loader's share."""
    t = rt.timing
    if not t.step_s:
        if t.error and not t.error.startswith(("no restore point", "not run")):
            return Check(
                "speed",
                "fail",
                f"a training step failed: {t.error}",
                "fix that error: the first training step would stop on it too",
            )
        return Check("speed", "warn", f"not measured: {t.error or 'no steps timed'}")
    acc = ckpt.accelerator
    steps_per_sec = 1.0 / t.step_s
    samples_per_sec = t.samples_per_step * steps_per_sec
    steps_per_epoch = math.ceil(ckpt.batches_per_epoch / cfg.trainer.grad_accum_steps)
    evals, saves = _count_events(cfg, total_steps, start_step, steps_per_epoch)
    save_s = rt.save_s or 0.0
    remaining = total_steps - start_step
    eta = remaining * t.step_s + len(evals) * t.eval_s + len(saves) * save_s
    rt.steps_per_sec, rt.eta_s = steps_per_sec, eta
    mfu = MFU(
        acc.unwrap_model(ckpt.model),
        acc.device,
        cfg.trainer.mixed_precision,
        cfg.trainer.get("peak_tflops"),
    )
    value = mfu.of(samples_per_sec, acc.num_processes)
    mfu_text = (
        f"MFU {value:.1%} ({mfu.peak_note})"
        if value is not None
        else f"MFU skipped: {mfu.reason_missing}"
    )
    loader_share = t.loader_s / t.step_s
    detail = (
        f"{steps_per_sec:.1f} steps/s, {samples_per_sec:.0f} samples/s "
        f"({t.steps} steps after {cfg.preflight.warmup_steps} warm-up); "
        f"ETA {_hms(eta)} for {remaining} steps = {remaining} x {t.step_s * 1e3:.1f} ms "
        f"+ {len(evals)} evaluations x {t.eval_s:.2f} s "
        f"+ up to {len(saves)} checkpoints x {save_s:.2f} s; "
        f"the loader alone takes {loader_share:.0%} of a step; {mfu_text}"
    )
    if loader_share > cfg.preflight.loader_warn_fraction:
        return Check(
            "speed",
            "warn",
            f"{detail}: the data loader is the bottleneck "
            f"(above preflight.loader_warn_fraction={cfg.preflight.loader_warn_fraction})",
            "raise data.num_workers, set data.pin_memory=true on GPUs, or make batches cheaper",
        )
    return Check("speed", "pass", detail)


# --- distributed, trackers -------------------------------------------------------------


def check_distributed(ckpt: CheckpointManager) -> Check:
    acc = ckpt.accelerator
    world = acc.num_processes
    if world == 1:
        return Check("distributed", "pass", "one process: nothing to all-reduce")
    ranks = torch.tensor([acc.process_index + 1.0], device=acc.device)
    total = acc.reduce(ranks, "sum")
    expected = world * (world + 1) / 2
    # A buffer the size of the gradients, as DDP all-reduces every step.
    numel = max(1, sum(p.numel() for p in ckpt.model.parameters() if p.requires_grad))
    buffer = torch.ones(numel, device=acc.device)
    _sync(acc.device)
    started = time.perf_counter()
    buffer = acc.reduce(buffer, "sum")
    _sync(acc.device)
    took = time.perf_counter() - started
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "?"
    if float(total) != expected or float(buffer[0]) != world:
        return Check(
            "distributed",
            "fail",
            f"all-reduce over {world} ranks gave {float(total)}, expected {expected}",
            f"check the {backend} network setup (parallel.master_addr, NCCL_SOCKET_IFNAME)",
        )
    return Check(
        "distributed",
        "pass",
        f"all-reduce over {world} ranks ({backend}) correct; gradient-sized "
        f"({_mib(numel * 4)}) all-reduce {took * 1e3:.1f} ms",
    )


def check_trackers(cfg: DictConfig) -> Check:
    parts, problems, fixes, warnings = [], [], [], []
    for name, settings in (cfg.tracker or {}).items():
        settings = settings or {}
        package = TRACKER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            problems.append(f"{name}: package {package!r} not installed")
            fixes.append(f"pip install {package}")
            continue
        if name == "csv":
            parts.append("csv: metrics.csv in the run dir")
        elif name == "wandb":
            mode = settings.get("mode") or os.environ.get("WANDB_MODE")
            key = bool(os.environ.get("WANDB_API_KEY")) or _netrc_has("api.wandb.ai")
            mode = mode or ("online" if key else "offline")
            if mode == "online" and not key:
                problems.append("wandb: online, but no API key (WANDB_API_KEY or wandb login)")
                fixes.append("wandb login, or run offline (WANDB_MODE=offline)")
            else:
                parts.append(f"wandb: {mode}" + (", key found" if key else ""))
        elif name == "mlflow":
            uri = (
                settings.get("tracking_uri")
                or os.environ.get("MLFLOW_TRACKING_URI")
                or "local store in the run dir"
            )
            remote = str(uri).startswith(("http://", "https://", "databricks"))
            if remote and not any(
                os.environ.get(v)
                for v in ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "DATABRICKS_TOKEN")
            ):
                warnings.append(f"mlflow: {uri} without credentials in the environment")
            else:
                parts.append(f"mlflow: {uri}")
        else:
            parts.append(f"{name}: ready" if package else f"{name}: no readiness check")
    if not cfg.tracker:
        parts.append("none configured")
    detail = "; ".join(parts + problems + warnings)
    if problems:
        return Check("trackers", "fail", detail, "; ".join(fixes))
    if warnings:
        return Check("trackers", "warn", detail, "set MLFLOW_TRACKING_TOKEN (or user/password)")
    return Check("trackers", "pass", detail)


def _netrc_has(host: str) -> bool:
    with contextlib.suppress(FileNotFoundError, netrc.NetrcParseError, OSError):
        return netrc.netrc().authenticators(host) is not None
    return False


# --- the report ----------------------------------------------------------------------------


def _table(report: dict[str, Any]) -> str:
    """The checks as a rich table, rendered to plain text for the log."""
    from rich.console import Console
    from rich.table import Table

    table = Table(show_lines=True)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail")
    for check in report["checks"]:
        table.add_row(check["name"], check["status"].upper(), check["detail"])
    e = report["estimates"]
    out = io.StringIO()
    console = Console(file=out, width=120, color_system=None, force_terminal=False)
    console.print(table)
    console.print(
        " | ".join(
            [
                f"steps/s {e['steps_per_sec']:.1f}" if e["steps_per_sec"] else "steps/s ?",
                f"ETA {_hms(e['eta_s'])}" if e["eta_s"] is not None else "ETA ?",
                f"checkpoint {_mib(e['checkpoint_bytes'])}"
                if e["checkpoint_bytes"]
                else "checkpoint ?",
                f"disk free {_mib(e['disk_free_bytes'])}"
                if e["disk_free_bytes"] is not None
                else "",
                f"peak memory {_mib(e['peak_memory_bytes'])}" if e["peak_memory_bytes"] else "",
            ]
        )
    )
    return out.getvalue().rstrip()


def _mib(n: int | float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))
