"""Preflight's checks: devices, memory, disk, speed and ETA, distributed, trackers.

Each returns a ``Check`` (pass, warn or fail, with the fix); ``report.py`` runs
them on every rank and writes the table and ``preflight.json``; ``probe.py``
measures what memory, disk and speed judge. docs/preflight.md.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather_object
from omegaconf import DictConfig

from .. import tracking
from ..throughput import Throughput

if TYPE_CHECKING:
    from ..checkpoint import CheckpointManager
    from ..state import TrainState
    from .probe import RoundTrip, Timing

SCRATCH = ".preflight"  # in the run dir: on the checkpoints' filesystem


class PreflightFailed(RuntimeError):
    """A preflight check failed; the run stops before training (exit code 1)."""

    exit_code = 1


@dataclass
class Check:
    name: str
    status: str  # pass | warn | fail
    detail: str
    fix: str = ""


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
                f"{gib(min(r['total'] for r in ranks))} each, "
                f"free {gib(min(r['free'] for r in ranks))} or more"
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
                f"RAM {gib(first['total'])} ({gib(first['free'])} available)"
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
    precision = acc.mixed_precision  # what accelerate runs (trainer.mixed_precision=auto resolved)
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


# --- memory, disk, speed ---------------------------------------------------------------


def local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def parameters(state: TrainState, timing: Timing) -> dict[str, int]:
    """The model's parameters (total, trainable: each shared one once) and, per rank,
    what its frozen ones save: no gradients, and no optimizer state at the bytes per
    trainable byte the optimizer holds after the timed steps (model.peft's base)."""
    unique = list({id(p): p for p in state.model.parameters()}.values())
    trainable = [p for p in unique if p.requires_grad]
    frozen_bytes = local_bytes(p for p in unique if not p.requires_grad)
    per_byte = timing.optimizer_bytes / max(1, local_bytes(trainable))
    return {
        "total": sum(p.numel() for p in unique),
        "trainable": sum(p.numel() for p in trainable),
        "saved_gradient_bytes": frozen_bytes,
        "saved_optimizer_bytes": int(frozen_bytes * per_byte),
    }


def check_memory(cfg: DictConfig, acc: Any, state: TrainState, timing: Timing) -> Check:
    params = list(state.model.parameters())
    param_bytes = local_bytes(params)
    grad_bytes = local_bytes(p for p in params if p.requires_grad)
    counts = parameters(state, timing)
    share = counts["trainable"] / max(1, counts["total"])
    saved = counts["saved_gradient_bytes"] + counts["saved_optimizer_bytes"]
    sizes = (
        f"parameters {counts['total']:,} ({counts['trainable']:,} trainable, {share:.2%}) "
        f"{mib(param_bytes)}, gradients {mib(grad_bytes)}, "
        f"optimizer state {mib(timing.optimizer_bytes)} per rank"
        + (
            f"; the frozen ones save {mib(saved)} per rank (gradients "
            f"{mib(counts['saved_gradient_bytes'])}, optimizer state "
            f"{mib(counts['saved_optimizer_bytes'])})"
            if saved
            else ""
        )
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
    device = acc.device
    warn_at = cfg.preflight.memory_warn_fraction
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        share = timing.peak_bytes / total
        detail = (
            f"{sizes}; peak {mib(timing.peak_bytes)} of {mib(total)} ({share:.0%}; "
            f"{timing.peak_source})"
        )
    else:
        total, _ = _ram()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        share = timing.peak_bytes * local / total
        detail = (
            f"{sizes}; peak {mib(timing.peak_bytes)} per process, {local} on this node: "
            f"{share:.0%} of {mib(total)} RAM ({timing.peak_source})"
        )
    if share > warn_at:
        return Check(
            "memory",
            "warn",
            f"{detail}: above preflight.memory_warn_fraction={warn_at}",
            "lower data.batch_size or use trainer.mixed_precision=bf16",
        )
    return Check("memory", "pass", detail)


def check_disk(
    cfg: DictConfig, run_dir: Path, free: int, rt: RoundTrip, ckpt: CheckpointManager
) -> Check:
    """Main process only: free space against the checkpoints kept, and a write test."""
    where = run_dir / "checkpoints"
    checkpoint_bytes = rt.checkpoint_bytes
    if checkpoint_bytes is None:
        why = rt.save_error or rt.timing.error
        # the disk advice for the file system's errors only (save.write_error says which)
        disk = "free disk space" in why
        return Check(
            "disk",
            "fail",
            f"{mib(free)} free at {where}; could not write one checkpoint to size it: {why}",
            "free disk space or put the run dir on a larger disk (hydra.run.dir=...)"
            if disk
            else "fix what the checkpoint check names (not a disk problem)",
        )
    if ckpt.enabled:
        count, why = ckpt.kept_on_disk()
        what = f"{count} checkpoints of {mib(checkpoint_bytes)} ({why})"
        need = count * checkpoint_bytes
    else:
        what, need = "the final weights (checkpoints are off)", rt.weights_bytes or 0
    written = _write_test(run_dir / SCRATCH, min(cfg.preflight.disk_test_mib * 2**20, free // 4))
    if written.startswith("error"):
        return Check(
            "disk",
            "fail",
            f"{mib(free)} free at {where}; the write test failed: {written}",
            "free disk space or fix the permissions of the run dir",
        )
    detail = f"{mib(free)} free at {where}, {what} need {mib(need)}; {written}"
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
        f"write + fsync + read-back of {mib(size)} ok ({size / max(took, 1e-9) / 2**20:.0f} MiB/s)"
    )


def check_speed(
    cfg: DictConfig,
    acc: Any,
    ckpt: CheckpointManager,
    rt: RoundTrip,
    plan: Any,
    throughput: Throughput,
    start_step: int,
) -> Check:
    """steps/s, samples/s, MFU and the ETA (stored in ``rt``); the loader's share. The
    steps, evaluations and saves are the run's own (``plan``, ``ckpt``)."""
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
    steps_per_sec = 1.0 / t.step_s
    samples_per_sec = t.samples_per_step * steps_per_sec
    evals = plan.evaluations(start_step)
    saves = ckpt.planned_saves(
        plan.total_steps, start_step, steps_per_epoch=plan.steps_per_epoch, evaluations=evals
    )
    save_s = rt.save_s or 0.0
    remaining = max(0, plan.total_steps - start_step)
    eta = remaining * t.step_s + len(evals) * t.eval_s + len(saves) * save_s
    rt.steps_per_sec, rt.eta_s = steps_per_sec, eta
    rt.eta_terms = {
        "steps_left": remaining,
        "step_s": t.step_s,
        "evaluations": len(evals),
        "eval_s": t.eval_s,
        "checkpoints": len(saves),
        "checkpoint_s": save_s,
    }
    rates = throughput.metrics(steps_per_sec, samples=t.samples, tokens=t.tokens)
    mfu_text = (
        f"MFU {rates['perf/mfu']:.1%} ({throughput.peak_note})"
        if "perf/mfu" in rates
        else f"MFU skipped: {throughput.reason_missing(t.tokens is not None)}"
    )
    loader_share = t.loader_s / t.step_s
    detail = (
        f"{steps_per_sec:.1f} steps/s, {samples_per_sec:.0f} samples/s "
        f"({t.steps} steps after {cfg.preflight.warmup_steps} warm-up); "
        f"ETA {hms(eta)} for {remaining} steps = {remaining} x {t.step_s * 1e3:.1f} ms "
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


def check_distributed(acc: Any, state: TrainState) -> Check:
    world = acc.num_processes
    if world == 1:
        return Check("distributed", "pass", "one process: nothing to all-reduce")
    ranks = torch.tensor([acc.process_index + 1.0], device=acc.device)
    total = acc.reduce(ranks, "sum")
    expected = world * (world + 1) / 2
    # A buffer the size of the gradients, as DDP all-reduces every step.
    numel = max(1, sum(p.numel() for p in state.model.parameters() if p.requires_grad))
    buffer = torch.ones(numel, device=acc.device)
    sync(acc.device)
    started = time.perf_counter()
    buffer = acc.reduce(buffer, "sum")
    sync(acc.device)
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
        f"({mib(numel * 4)}) all-reduce {took * 1e3:.1f} ms",
    )


def check_trackers(cfg: DictConfig) -> Check:
    status, detail, fix = tracking.readiness(cfg)
    return Check("trackers", status, detail, fix)


# --- formatting ------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mib(n: int | float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))
