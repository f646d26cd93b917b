"""Preflight: run every check on every rank, report, and stop the run on a fail.

``train.py`` calls ``run_preflight`` after the state is prepared (and resumed),
before the first step; ``preflight.only=true`` runs it alone (exit 0 or 1). The
report is a table in the log and ``preflight.json`` in the run dir. The checks
are in ``checks.py``, the round trip and timed steps in ``probe.py``.
docs/preflight.md.
"""

from __future__ import annotations

import io
import logging
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate.utils import gather_object
from omegaconf import DictConfig

from ..checkpoint import CheckpointManager
from ..files import write_json_atomic
from ..state import TrainState
from .checks import (
    SCRATCH,
    Check,
    PreflightFailed,
    check_devices,
    check_disk,
    check_distributed,
    check_memory,
    check_speed,
    check_trackers,
    hms,
    mib,
    parameters,
)
from .probe import round_trip_and_timing, scratch_dir

log = logging.getLogger(__name__)

STATUSES = ("pass", "warn", "fail")


def run_preflight(
    cfg: DictConfig,
    *,
    run_dir: Path,
    accelerator: Any,
    state: TrainState,
    ckpt: CheckpointManager,
    plan: Any,
    throughput: Any,
    start_step: int,
) -> dict[str, Any] | None:
    """Run every check on every rank, report on the main process, and raise
    PreflightFailed (on every rank) when any check failed. Returns the report
    (``preflight.json``'s content), or None with ``preflight.enabled=false``.
    ``state`` is what preflight times and restores (through ``ckpt``); the ETA asks
    the run's ``plan`` (loaders.RunPlan: length, cadence, accumulation), ``ckpt``
    (the saves it plans) and the run's ``throughput`` (MFU), never re-derives them."""
    if not cfg.preflight.enabled:
        return None
    acc = accelerator
    started = time.perf_counter()
    world = acc.num_processes

    checks = [_guard("devices", world, lambda: check_devices(cfg, acc))]
    free = shutil.disk_usage(run_dir).free if acc.is_main_process else None
    scratch = run_dir / SCRATCH
    with scratch_dir(scratch, acc):
        rt = round_trip_and_timing(cfg, scratch, acc, state, ckpt, start_step)
        checks.append(_guard("memory", world, lambda: check_memory(cfg, acc, state, rt.timing)))
        checks.append(rt.check)
        checks.append(
            _guard("disk", world, lambda: check_disk(cfg, run_dir, free, rt, ckpt))
            if acc.is_main_process
            else Check("disk", "pass", "checked by the main process")
        )
    speed = _guard(
        "speed", world, lambda: check_speed(cfg, acc, ckpt, rt, plan, throughput, start_step)
    )
    checks.append(speed)
    checks.append(_guard("distributed", world, lambda: check_distributed(acc, state)))
    checks.append(_guard("trackers", world, lambda: check_trackers(cfg)))
    estimates = {
        "steps_per_sec": rt.steps_per_sec,
        "eta_s": rt.eta_s,
        **rt.eta_terms,  # what the ETA sums: steps, evaluations, checkpoints, each's time
        "checkpoint_bytes": rt.checkpoint_bytes,
        "disk_free_bytes": free,
        "peak_memory_bytes": rt.timing.peak_bytes,
        # total and trainable; what the frozen ones save per rank (model.peft)
        "parameters": parameters(state, rt.timing),
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


def _table(report: dict[str, Any]) -> str:
    """The checks as a rich table, rendered to plain text for the log."""
    drawn = random.getstate()  # rich, imported and used here, draws from python's global
    # RNG: the run's random numbers must not depend on preflight being on
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
                f"ETA {hms(e['eta_s'])}" if e["eta_s"] is not None else "ETA ?",
                f"checkpoint {mib(e['checkpoint_bytes'])}"
                if e["checkpoint_bytes"]
                else "checkpoint ?",
                f"disk free {mib(e['disk_free_bytes'])}"
                if e["disk_free_bytes"] is not None
                else "",
                f"peak memory {mib(e['peak_memory_bytes'])}" if e["peak_memory_bytes"] else "",
            ]
        )
    )
    random.setstate(drawn)
    return out.getvalue().rstrip()
