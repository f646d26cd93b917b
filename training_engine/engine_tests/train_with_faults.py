"""``python engine_tests/train_with_faults.py OVERRIDES``: train.py with the pause at
``CKPT_TEST_PAUSE_AT=MOMENT[@STEP][#RANK][+SECONDS]`` switched on.

MOMENT is one of ``training_engine.moments``' (LIFE: claim, preflight, first_step, step,
eval, save, final_checkpoint, final_weights, trackers, summary, exit; SAVE: the moments
of a save: between_files, before_rename, before_pointers, pruning). The first time a
process of a launch's first attempt reaches it (at STEP, on RANK: the RANK variable, 0
when unset, where given)
it prints ``CKPT_TEST_PAUSED MOMENT step N rank R pid P`` to stderr and waits, so a
test can signal that process exactly there: SIGKILL ends it; a stop signal (SIGTERM,
SIGINT, SIGUSR1, SIGUSR2) ends the wait and then gets what the run does with it at
that moment (the run's handler, or the default action); SECONDS (else an hour) end it
too. The hook is installed when this file is imported, so spawned DDP workers (which
import the parent's main script) have it too; production code carries only the no-op
``moments.reached``.
"""

import os
import signal
import sys
import time
from pathlib import Path

from training_engine import moments

# The project under test (engine_tests/conftest.py): its train.py.
TRAIN = Path(os.environ.get("TRAINING_ENGINE_PROJECT") or Path.cwd()) / "train.py"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
_paused = False  # once per process: a pause at "step" stops at the first step only


def reached(moment: str, step: int | None = None) -> None:
    global _paused
    wanted = os.environ.get("CKPT_TEST_PAUSE_AT")
    if not wanted or _paused:
        return
    where, _, seconds = wanted.partition("+")
    where, _, rank = where.partition("#")
    name, _, at = where.partition("@")
    mine = os.environ.get("RANK", "0")
    if name != moment or (at and int(at) != step) or (rank and rank != mine):
        return
    if os.environ.get("TRAIN_ATTEMPT", "0") != "0":  # a restarted group goes on
        return
    _paused = True
    pid = os.getpid()
    print(
        f"CKPT_TEST_PAUSED {moment} step {step} rank {mine} pid {pid}", file=sys.stderr, flush=True
    )
    _wait(float(seconds or 3600))


def _wait(seconds: float) -> None:
    """Until a stop signal comes (then handled as the run would at this moment) or
    ``seconds`` pass. Off the main thread (an async save) no handler can be set: a
    plain wait."""
    got: list[int] = []
    try:
        before = {s: signal.signal(s, lambda signum, _: got.append(signum)) for s in STOP_SIGNALS}
    except ValueError:
        before = {}
    deadline = time.monotonic() + seconds
    while not got and time.monotonic() < deadline:
        time.sleep(0.005)
    for signum, handler in before.items():
        signal.signal(signum, handler)
    for signum in got:  # what the run would have done with it here
        handler = before[signum]
        if callable(handler):
            handler(signum, None)
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), signum)


moments.reached = reached

# train.py's code runs in this module's namespace: its functions belong to this
# main module, so spawned workers (which import it as __mp_main__) find them
# after installing the hook above; train.py's own __main__ guard starts the run.
exec(compile(TRAIN.read_text(), str(TRAIN), "exec"))
