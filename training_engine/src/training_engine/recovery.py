"""In-job recovery's record (docs/recovery.md): what failed, when it was noticed,
and what the restart cost.

Everything about one attempt lives in ``run_dir/hangs/<attempt>/``: the ranks'
heartbeats and, after a hang, their stacks and reports (watchdog.py); after a
failure, the launcher's note of the rank that failed first and how
(``failure.json``, launch.py; torchrun writes none: then the heartbeats say which
ranks stopped first). The restarted attempt's main process reads them once it has
restored the checkpoint and writes the recovery's entry (``recovery.json``); the run
dir's ``recoveries.json`` keeps every entry, of every launch, and the summary lists
them (``history``).
Nothing read here is executed; a malformed file counts as absent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

from . import trust
from .checkpoint import final_weights_problem
from .files import write_json_atomic
from .watchdog import EXIT_HANG, STEP_FILE, attempt, attempt_dir, last_steps, read_beats

log = logging.getLogger(__name__)
RECOVERIES = "recoveries.json"  # in the run dir: every recovery of the run, every launch

# Exit codes a restart cannot help (entry.py): bad input, a non-finite loss, a pruned
# trial; and the stop signals (128 + N: SIGINT, SIGUSR1, SIGUSR2, SIGTERM), which
# saved and stopped on purpose: a stop is never mistaken for a failure.
NOT_RESTARTED = {2, 3, 4, 130, 138, 140, 143}


def cause_of(exit_code: int) -> str:
    """``exit_code`` as torch elastic reports it (negative: killed by that signal)."""
    if exit_code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-exit_code).name
        return f"signal {-exit_code}"
    if exit_code == EXIT_HANG:
        return "hang"
    return f"exit code {exit_code}"


def exit_status(exit_code: int) -> int:
    """A shell's exit status for elastic's code: 128 + N for signal N."""
    return exit_code if exit_code >= 0 else 128 - exit_code


# A rank's exception that a lost peer or a network fault causes, which a restart can
# outlive (torch's DistError family, gloo's and NCCL's words for a peer gone or late).
TRANSIENT = (
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL error",
    "Timed out",
    "timed out",
)


def not_restartable(exit_code: int, run_dir: Path, number: int, error: str) -> str | None:
    """Why a failed attempt is not worth another (None: it is). Restarts are for faults
    that can pass: a lost process (a signal), a hang (the watchdog's exit 5), a peer's
    or the network's fault. Not for a deliberate or deterministic stop (bad input, a
    non-finite loss, a pruned trial, a stop signal), nor for an error the program
    raised (exit 1: an exception, a full disk, a failed check), which repeats at the
    same step; nor for an attempt that never reached the loop (no heartbeats)."""
    status = exit_status(exit_code)
    if status in NOT_RESTARTED:
        return f"exit code {status} is a deliberate or deterministic stop"
    if not read_beats(attempt_dir(run_dir, number)):
        return "the attempt failed before training began: it would fail the same way"
    if status == 1 and not any(marker in error for marker in TRANSIENT):
        return (
            "an error the program raised repeats when the group is restarted (restarts are "
            "for lost processes, hangs and lost peers): fix it, then run the same command"
        )
    return None


def note_failure(run_dir: Path, number: int, *, rank: int, exit_code: int, message: str) -> None:
    """The launcher's note of how attempt ``number`` failed (the first failure). A
    launch's first attempt that never reached the loop leaves the run dir as it was."""
    folder = attempt_dir(run_dir, number)
    if number == 0 and not read_beats(folder):
        return
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        note = {"rank": rank, "cause": cause_of(exit_code), "at": time.time()}
        write_json_atomic(folder / "failure.json", {**note, "message": message[-2000:]})


def clear_failure(run_dir: Path, number: int) -> None:
    """Before attempt ``number`` starts: an earlier launch's notes are not its own."""
    folder = attempt_dir(run_dir, number)
    for name in ("failure.json", "recovery.json"):
        (folder / name).unlink(missing_ok=True)
    for path in folder.glob(f"{STEP_FILE}*"):  # a launch's attempt's, of more ranks maybe
        path.unlink(missing_ok=True)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _ranks(value: Any) -> list[int]:
    return [r for r in value if isinstance(r, int)] if isinstance(value, list) else []


def describe(run_dir: Path, number: int) -> dict[str, Any]:
    """Attempt ``number``'s failure: cause, ranks, when it was noticed, and where
    each rank was (from ``hangs/<number>/``)."""
    folder = attempt_dir(run_dir, number)
    beats = read_beats(folder)
    reports = sorted(
        (_read(p) for p in folder.glob("report_rank*.json")), key=lambda r: r.get("at", 0)
    )
    failure = _read(folder / "failure.json")
    if reports:  # a watchdog fired: the ranks it named as stalled
        first = reports[0]
        ranks = _ranks(first.get("ranks"))
        cause = f"hang in {first.get('phase')} (budget {first.get('budget_s')}s)"
        noticed = float(first.get("at", 0))
    elif failure:
        ranks = _ranks([failure.get("rank")])
        cause, noticed = str(failure.get("cause")), float(failure.get("at", 0))
    else:  # under torchrun: the ranks whose heartbeats stopped first
        alive = {r: float(b.get("alive_at", 0)) for r, b in beats.items()}
        first_gone = min(alive.values(), default=0.0)
        ranks = sorted(r for r, t in alive.items() if t - first_gone < 1.0)
        cause, noticed = (
            "a worker exited (its status is in the launcher's log)",
            max(alive.values(), default=0.0),
        )
    progress = [float(beats[r].get("progress_at", 0)) for r in ranks if r in beats]
    return {
        "cause": cause,
        "ranks": ranks,
        "detected_after_s": round(noticed - min(progress), 1) if progress and noticed else None,
        # the furthest step any rank completed: written at every step (a heartbeat, once
        # a second, can be a second stale)
        "last_step": max(
            [*last_steps(folder).values(), *(int(b.get("step", 0)) for b in beats.values())],
            default=0,
        ),
        "started_at": max((float(b.get("started_at", 0)) for b in beats.values()), default=0.0),
    }


def note_recovery(run_dir: Path, resume: Any, accelerator: Any) -> dict[str, Any] | None:
    """In a restarted attempt, once the checkpoint ``resume`` (a ResumePlan) is
    restored: the entry of the attempt before (main process: written and logged)."""
    number = attempt()
    if number == 0 or not accelerator.is_main_process:
        return None
    failed = describe(run_dir, number - 1)
    now = time.time()
    saved_at = 0.0
    if resume.checkpoint is not None:
        with contextlib.suppress(OSError):
            saved_at = (Path(resume.checkpoint) / "MANIFEST.json").stat().st_mtime
    entry = {
        "attempt": number - 1,  # the attempt that failed (0: the launch's first)
        "cause": failed["cause"],
        "ranks": failed["ranks"],
        "detected_after_s": failed["detected_after_s"],
        "resumed_from_step": resume.step,
        "steps_redone": max(0, failed["last_step"] - resume.step),
        # from the last moment the work was safe (the checkpoint, or the failed
        # attempt's own start if it saved none) to training again
        "seconds_lost": round(now - max(saved_at, failed["started_at"]), 1),
    }
    write_json_atomic(attempt_dir(run_dir, number - 1) / "recovery.json", entry)
    # the run's whole history, across launches (a launch's hangs/<attempt>/ are reused)
    write_json_atomic(Path(run_dir) / RECOVERIES, [*history(run_dir), entry])
    ranks = ", ".join(map(str, entry["ranks"])) or "?"
    log.warning(
        f"recovered from attempt {entry['attempt']}'s failure (rank {ranks}: {entry['cause']}, "
        f"detected after {entry['detected_after_s']}s): resuming from step "
        f"{entry['resumed_from_step']}, {entry['steps_redone']} steps redone, "
        f"{entry['seconds_lost']}s lost"
    )
    return entry


def history(run_dir: Path) -> list[dict[str, Any]]:
    """Every recovery of the run, of every launch (``recoveries.json``): the summary's
    ``recoveries``. A malformed file counts as none."""
    try:
        entries = trust.read_json(Path(run_dir) / RECOVERIES)
    except (OSError, trust.Malformed):
        return []
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def write_failed_summary(
    run_dir: Path, number: int, message: str, not_restarted: str | None = None
) -> None:
    """A failed launch (the launcher): ``summary.json`` holds the history and why no
    restart was made (no ``best``: claim.py reads it as a run to continue, not a
    finished one)."""
    failed = describe(run_dir, number)
    finished = _read(Path(run_dir) / "summary.json")
    if "best" in finished and final_weights_problem(run_dir, finished.get("final_weights")) is None:
        log.error(f"attempt {number} failed after the run had finished: summary.json stays")
        return  # e.g. a worker killed on its way out: a finished run keeps its record
    summary = {
        "status": "failed",
        "failure": {"attempt": number, **{k: failed[k] for k in ("cause", "ranks")}},
        "message": message[-2000:],
        "recoveries": history(run_dir),
        "not_restarted": not_restarted or "restarts exhausted (parallel.max_restarts)",
    }
    with contextlib.suppress(OSError):  # a full disk: the console has the report anyway
        write_json_atomic(Path(run_dir) / "summary.json", summary)
    why = not_restarted or "restarts exhausted"
    log.error(
        f"{why}: attempt {number} failed ({failed['cause']}, rank(s) {failed['ranks']}); "
        f"{len(summary['recoveries'])} recoveries before it "
        f"(summary: {Path(run_dir) / 'summary.json'})"
    )
