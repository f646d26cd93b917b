"""Hang detection on every rank (docs/recovery.md).

A thread per rank knows where the loop is (``start``: the first step of this
attempt, ``step``: a step done, ``phase("eval")`` / ``phase("save")``) and gives
each phase its own budget:

- the first step of an attempt (compile, autotuning, data workers): ``first_step_s``;
- a step: ``max(step_floor_s, step_factor x p95 of this attempt's step times)``;
- an evaluation / a checkpoint save: ``max(floor, 3 x the longest one measured)``.

An evaluation or a save that waits longer than a step's budget while a peer's
heartbeat (below) has stopped for as long is a hang too: a stopped or dead peer is
found within the step budget whatever the phase.

When a budget runs out, the rank writes every thread's Python stack to
``run_dir/hangs/<attempt>/rank<r>.txt`` (on NCCL also the flight recorder's dump),
logs one line naming the ranks that made no progress and where they stopped, and
exits with ``EXIT_HANG``: the launcher ends the group (and with
``parallel.max_restarts``, restarts it from the last checkpoint).

Which ranks stopped: a rank that is stopped (SIGSTOP), dead, or stuck holding the
GIL cannot say so itself; the ranks waiting for it in a collective can. Every
rank's thread therefore writes a small heartbeat file (its step, phase, when it
last made progress, and that its thread still runs) into ``hangs/<attempt>/``
every ``poll_s``. Files rather than the TCPStore: they need no process group
(which is what hangs), they outlive the process for the restarted attempt's
recovery record and for a person, and the run dir is shared by every node
already (run_dir.check_shared_storage).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import mmap
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from .schema import section

log = logging.getLogger(__name__)

EXIT_HANG = 5  # entry.py: a rank gave up waiting (a hang); the launcher may restart
STEP_FILE = "step_rank"  # + rank: the last step a rank completed (recovery.py reads it)
# The phases a rank is in, each with its budget (among moments.LIFE: the fault matrix's)
PHASES = ("first_step", "step", "eval", "save")
HANGS = "hangs"
# One step time that is k x p95 of the others is a hang, not jitter; and a save or an
# evaluation three times as long as the longest seen so far.
PHASE_FACTOR = 3.0
STEP_WINDOW = 200  # the step times the p95 is taken over (the recent ones)


def attempt() -> int:
    """This launch's attempt: 0, then 1, 2, ... after each in-job restart (our own
    launcher's, launch.py, or torchrun --max-restarts')."""
    for var in ("TRAIN_ATTEMPT", "TORCHELASTIC_RESTART_COUNT"):
        text = os.environ.get(var, "")
        if text.isdigit():
            return int(text)
    return 0


def attempt_dir(run_dir: Path, number: int | None = None) -> Path:
    return Path(run_dir) / HANGS / str(attempt() if number is None else number)


def last_steps(folder: Path) -> dict[int, int]:
    """The last step each rank completed in an attempt (``step_rank<r>``), by rank."""
    steps = {}
    for path in folder.glob(f"{STEP_FILE}*"):
        with contextlib.suppress(OSError, ValueError):
            data = path.read_bytes()[:8]
            if len(data) == 8:
                steps[int(path.name.removeprefix(STEP_FILE))] = int.from_bytes(data, "little")
    return steps


def read_beats(folder: Path) -> dict[int, dict[str, Any]]:
    """The heartbeats in ``folder`` by rank; a malformed one is left out."""
    beats = {}
    for path in folder.glob("beat_rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            beat = json.loads(path.read_text())
            if isinstance(beat, dict) and isinstance(beat.get("rank"), int):
                beats[beat["rank"]] = beat
    return beats


def stalled_ranks(beats: Mapping[int, dict], world_size: int, now: float, stale_s: float) -> list:
    """The ranks that made no progress: those whose watchdog thread no longer beats
    (stopped, dead, or holding the GIL) or never beat; if every rank is alive (all
    waiting on each other, or on storage), those furthest behind."""
    gone = [
        r
        for r in range(world_size)
        if r not in beats or now - float(beats[r].get("alive_at", 0)) > stale_s
    ]
    if gone or not beats:
        return gone
    lowest = min(int(b.get("step", 0)) for b in beats.values())
    behind = sorted(r for r, b in beats.items() if int(b.get("step", 0)) == lowest)
    return behind


class Watchdog:
    """The loop's progress on this rank and the thread that acts on a hang.
    ``settings``: the config's ``watchdog`` group; ``enabled: auto`` watches runs
    of two or more processes (one process has no peer to wait for, no launcher
    to restart it)."""

    def __init__(
        self, settings: Mapping[str, Any], *, run_dir: Path, rank: int, world_size: int
    ) -> None:
        settings = section("watchdog", settings)  # every key (schema/run.py)
        enabled = settings.enabled
        self.enabled = world_size > 1 if enabled == "auto" else bool(enabled)
        self.first_step_s = settings.first_step_s
        self.step_floor_s = settings.step_floor_s
        self.step_factor = settings.step_factor
        self.floors = {"eval": settings.eval_s, "save": settings.save_s}
        self.poll_s = settings.poll_s
        self.collective_timeout_s = settings.collective_timeout_s
        self.rank, self.world_size = rank, world_size
        self.folder = attempt_dir(run_dir)
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._longest: dict[str, float] = {}
        # (phase, since: monotonic, since: wall clock, last step done): one tuple, so
        # the thread always reads a consistent one
        self._where = ("first_step", time.monotonic(), time.time(), 0)
        self._started_at = time.time()
        self._start_step = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress: mmap.mmap | None = None  # step_rank<r>: the last step done, 8 bytes

    # --- the loop's verbs ----------------------------------------------------------

    def start(self, step: int) -> None:
        """The loop begins (at ``step``: 0, or where the attempt resumed)."""
        if not self.enabled:
            return
        self._start_step = step
        self._started_at = time.time()
        self._where = ("first_step", time.monotonic(), self._started_at, step)
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in (f"rank{self.rank}.txt", f"report_rank{self.rank}.json"):
            (self.folder / stale).unlink(missing_ok=True)  # an earlier launch's
        self._beat()
        # the last step this rank completed, rewritten in place at every step (8 bytes, no
        # fsync: a killed process's writes stay in the page cache): what a recovery redid.
        # Mapped, not written: a pwrite per step (a syscall and the file's mtime) cost
        # ~30 us of a 2-process CPU step, a store into the page ~1 us.
        path = self.folder / f"{STEP_FILE}{self.rank}"
        with contextlib.suppress(OSError, ValueError):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                # written, not truncated to size: the block is allocated now, so a store
                # into the page can never meet a full disk (a sparse page would SIGBUS)
                os.write(fd, step.to_bytes(8, "little"))
                self._progress = mmap.mmap(fd, 8)
            finally:
                os.close(fd)
        self._record(step)
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    def on_step_end(self, run: Any) -> None:
        """The loop's event (callbacks.py): a step was taken."""
        self.step(run.step)

    def step(self, step: int) -> None:
        """An optimizer step is done."""
        if not self.enabled:
            return
        phase, since, _, _ = self._where
        now = time.monotonic()
        if phase == "step":
            self._steps.append(now - since)
        elif phase == "first_step":
            self._tighten_collectives()
        self._where = ("step", now, time.time(), step)
        self._record(step)

    def _record(self, step: int) -> None:
        if self._progress is not None:
            self._progress[:8] = step.to_bytes(8, "little")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """An evaluation or a save (``name``: eval | save) with its own budget;
        the step clock restarts after it."""
        if name not in self.floors:
            raise ValueError(f"{name!r} is not a phase with its own budget: {PHASES[2:]}")
        if not self.enabled:
            yield
            return
        _, _, _, step = self._where
        began = time.monotonic()
        self._where = (name, began, time.time(), step)
        try:
            yield
        finally:
            took = time.monotonic() - began
            self._longest[name] = max(self._longest.get(name, 0.0), took)
            self._where = ("step", time.monotonic(), time.time(), step)

    def close(self) -> None:
        """The loop ended well: stop the thread, remove this rank's heartbeat (a
        clean run leaves no ``hangs/`` folder)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        (self.folder / f"beat_rank{self.rank}.json").unlink(missing_ok=True)
        (self.folder / f"{STEP_FILE}{self.rank}").unlink(missing_ok=True)
        for folder in (self.folder, self.folder.parent):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty: an earlier attempt's record stays

    # --- budgets ----------------------------------------------------------------------

    def budget(self, phase: str) -> float:
        if phase == "first_step":
            return self.first_step_s
        if phase == "step":
            if not self._steps:
                return max(self.step_floor_s, self.first_step_s)  # no step measured yet
            ordered = sorted(self._steps)
            p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
            return max(self.step_floor_s, self.step_factor * p95)
        return max(self.floors[phase], PHASE_FACTOR * self._longest.get(phase, 0.0))

    def _tighten_collectives(self) -> None:
        """After the first step, a collective waits ``collective_timeout_s`` at
        most (the first step's compile and warm-up ran under parallel.timeout_s,
        which stays when it is the shorter one)."""
        if not self.collective_timeout_s:
            return
        from .accel import collective_timeout, set_collective_timeout

        try:
            current = collective_timeout()
            wanted = timedelta(seconds=float(self.collective_timeout_s))
            if current is not None and wanted < current:
                set_collective_timeout(wanted.total_seconds())
                log.info(
                    f"collective timeout after the first step: {wanted.total_seconds():.0f}s "
                    f"(until then {current.total_seconds():.0f}s)"
                )
        except (AttributeError, ImportError, RuntimeError, ValueError) as err:  # private API
            log.warning(f"could not tighten the collective timeout: {err}")

    # --- the thread ----------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            phase, since, _, step = self._where
            waited = time.monotonic() - since
            self._beat()
            budget = self.budget(phase)
            if waited > budget and not self._stop.is_set():
                self._fire(phase, step, waited, budget)
            # A long phase (an evaluation, a save) waiting on a peer that is gone: its
            # heartbeat stopped a step budget ago. Read only then (files, not every poll).
            step_budget = self.budget("step")
            if phase in self.floors and waited > step_budget and self._peer_gone(step_budget):
                self._fire(phase, step, waited, step_budget)

    def _peer_gone(self, for_s: float) -> bool:
        now = time.time()
        beats = read_beats(self.folder)
        return any(
            now - float(beats[r].get("alive_at", now)) > for_s
            for r in range(self.world_size)
            if r != self.rank and r in beats
        )

    def _beat(self) -> None:
        phase, _, since_wall, step = self._where
        beat = {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "step": step,
            "phase": phase,
            "progress_at": since_wall,  # when this rank last made progress
            "alive_at": time.time(),  # this thread runs: the process is not stopped
            "started_at": self._started_at,
            "start_step": self._start_step,
        }
        path = self.folder / f"beat_rank{self.rank}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        # no fsync: a reader needs a whole file, not a durable one
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(beat))
            os.replace(tmp, path)

    def _fire(self, phase: str, step: int, waited: float, budget: float) -> None:
        """The budget ran out: stacks, one log line, the report, exit."""
        now = time.time()
        stale_s = max(5.0, 3 * self.poll_s)
        stalled = stalled_ranks(read_beats(self.folder), self.world_size, now, stale_s)
        beats = read_beats(self.folder)
        where = "; ".join(
            f"rank {r}: after step {beats[r].get('step')} in {beats[r].get('phase')}"
            if r in beats
            else f"rank {r}: no heartbeat"
            for r in stalled
        )
        stacks = self.folder / f"rank{self.rank}.txt"
        with contextlib.suppress(OSError), open(stacks, "w") as f:
            f.write(
                f"rank {self.rank} pid {os.getpid()}: no progress for {waited:.1f}s in "
                f"{phase} after step {step} (budget {budget:.1f}s)\n\n"
            )
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        self._flight_recorder()
        names = ", ".join(map(str, stalled)) or "none"
        message = (
            f"hang: rank(s) {names} made no progress ({where or 'every rank alive'}); "
            f"rank {self.rank} waited {waited:.0f}s in {phase} after step {step} "
            f"(budget {budget:.0f}s); stacks in {self.folder}"
        )
        report = {
            "rank": self.rank,
            "ranks": stalled,
            "phase": phase,
            "step": step,
            "waited_s": round(waited, 1),
            "budget_s": round(budget, 1),
            "at": now,
            "message": message,
        }
        with contextlib.suppress(OSError):
            (self.folder / f"report_rank{self.rank}.json").write_text(json.dumps(report))
        log.error(message)
        _record_for_the_launcher(message)
        _end_stopped_siblings({r: beats[r] for r in stalled if r in beats}, now, stale_s)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        os._exit(EXIT_HANG)

    def _flight_recorder(self) -> None:
        """On NCCL: the flight recorder's record of the recent collectives."""
        try:
            import torch
            import torch.distributed as dist

            if not (dist.is_initialized() and "nccl" in str(dist.get_backend())):
                return
            dump = torch._C._distributed_c10d._dump_nccl_trace()
            (self.folder / f"rank{self.rank}.nccl_trace.pkl").write_bytes(dump)
        except Exception as err:  # a private API, absent in some builds
            log.warning(f"no NCCL flight recorder dump: {err}")


def _record_for_the_launcher(message: str) -> None:
    """The torchelastic error file (when launched by it): the launcher's report then
    shows this line, not an exit code alone."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    with contextlib.suppress(Exception):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(HangDetected(message))


def _end_stopped_siblings(beats: Mapping[int, dict], now: float, stale_s: float) -> None:
    """SIGKILL the stalled ranks that are this rank's siblings (same host, same
    launcher) and whose watchdog no longer beats: a stopped process ignores the
    launcher's SIGTERM, which then waits 30 s before its SIGKILL. The pid read
    from a heartbeat is only signalled when /proc says that it is a sibling."""
    import signal

    for beat in beats.values():
        pid = beat.get("pid")
        if not isinstance(pid, int) or pid == os.getpid() or pid <= 1:
            continue
        if beat.get("host") != socket.gethostname():
            continue
        if now - float(beat.get("alive_at", now)) <= stale_s:
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getppid():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue


class HangDetected(RuntimeError):
    exit_code = EXIT_HANG
