"""Two training processes (or two ``torchrun`` groups) that take turns: how
``bench.py`` times ours against the bare loop, steps/s of whole processes.

Why turns: between processes, steps/s on a shared VM drifts far more than the
2-3 % these figures judge. Measured on a 2-core VM: the same bare process went
from 189 to 104 steps/s over twelve runs in two minutes, with no steal time
and no other load (bench/README.md). Run one after the other, two sides
see different machines. So both sides run at once, but only one trains at a
time: every ``every`` optimizer steps each rank's step hook says "done" on a
pipe and waits for "go"; the parent hands the turn on (in rotating order) and
times each side's blocks from its "go" to its last rank's "done". Both
sides see the same second of the machine, and each is its whole process:
``train.py``'s loop with its bookkeeping, log steps, threads and settings,
which the in-process ``step_ratio`` cannot see. A side that waits for its turn
blocks in ``read``: it uses no CPU.

Hand-written because no benchmark library runs two processes in lockstep
(pytest-benchmark and pyperf time one callable at a time, in one process).
"""

import os
import select
import signal
import subprocess
import time
from pathlib import Path

WAIT_S = 600  # one block (or a start-up) that takes longer: the side is stuck


class Turn:
    """The child's side, called by the step hook after every optimizer step."""

    def __init__(self, folder: str, side: str, every: int) -> None:
        rank = os.environ.get("RANK", "0")
        self.go = os.open(f"{folder}/{side}.rank{rank}.go", os.O_RDONLY)
        self.done = os.open(f"{folder}/{side}.rank{rank}.done", os.O_WRONLY)
        self.every, self.steps = every, 0

    def after_step(self) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            os.write(self.done, b".")
            os.read(self.go, 1)  # blocks (no CPU) until it is this side's turn again


def run_in_turns(
    commands: dict[str, list[str]],
    folder: Path,
    *,
    ranks: int,
    every: int,
    blocks: int,
    untimed: int,
    cwd: Path,
) -> dict[str, list[float]]:
    """Start every side's command (its step hook makes a ``Turn(folder, side,
    every)``), let each run ``blocks`` blocks of ``every`` steps in turns, and return each
    side's seconds per block after its first ``untimed`` (the first block of
    each runs while the other starts up). Raises SystemExit naming a side that
    exits early or stops answering, with the end of its output."""
    fds: dict[tuple[str, int, str], int] = {}
    for side in commands:
        for rank in range(ranks):
            for end in ("go", "done"):
                path = folder / f"{side}.rank{rank}.{end}"
                os.mkfifo(path)
                # O_RDWR: opening never blocks, and a child's open never waits for us.
                fds[side, rank, end] = os.open(path, os.O_RDWR)
    procs, logs = {}, {}
    for side, command in commands.items():
        logs[side] = folder / f"{side}.log"
        with open(logs[side], "w") as log:
            procs[side] = subprocess.Popen(
                command,
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # torchrun's workers too go with a kill of the group
            )

    def kill_all() -> None:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def failed(side: str, why: str) -> SystemExit:
        kill_all()
        tail = logs[side].read_text()[-3000:]
        return SystemExit(f"bench: the {side} process {why}:\n{tail}")

    def wait_done(side: str) -> None:
        for rank in range(ranks):
            deadline = time.monotonic() + WAIT_S
            while not select.select([fds[side, rank, "done"]], [], [], 1.0)[0]:
                if procs[side].poll() is not None:
                    raise failed(side, f"exited early (exit {procs[side].returncode})")
                if time.monotonic() > deadline:
                    raise failed(side, f"did not finish a block within {WAIT_S} s")
            os.read(fds[side, rank, "done"], 1)

    def go(side: str) -> None:
        for rank in range(ranks):
            os.write(fds[side, rank, "go"], b".")

    seconds: dict[str, list[float]] = {side: [] for side in commands}
    try:
        for side in commands:
            wait_done(side)  # the first block: both sides at once, with start-up
        sides = list(commands)
        for block in range(1, blocks):
            # The order rotates (2 sides: AB BA AB ..., 3: ABC BCA CAB ...): every side
            # as often first and after each other side, so drift and warm caches hit all.
            shift = block % len(sides)
            for side in sides[shift:] + sides[:shift]:
                started = time.perf_counter()
                go(side)
                wait_done(side)
                if block >= untimed:
                    seconds[side].append(time.perf_counter() - started)
        for side in commands:
            go(side)  # the rest of the run (evaluation, the last checkpoint), both at once
        for side, proc in procs.items():
            if proc.wait(timeout=WAIT_S) != 0:
                raise failed(side, f"failed (exit {proc.returncode})")
    finally:
        kill_all()
        for fd in fds.values():
            os.close(fd)
    return seconds
