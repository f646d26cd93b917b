"""Stop signals: the handlers, the hand-on to a handler installed before ours
(submitit's requeue), and the exit codes.

SIGTERM, SIGUSR1, SIGUSR2 and Ctrl-C set a flag; at the next step boundary where the
ranks agree on it (agreement.py: every step with one process or ``trainer.on_nan=skip``,
else every ``trainer.log_every_n_steps`` steps: a signal may reach one rank only, and
it rides along the loss guard's all-reduce, never one of its own) the run saves a
checkpoint and exits with 128 + signal number (143, 138, 140, 130). A second Ctrl-C
stops at once. docs/checkpoints.md.
"""

import contextlib
import logging
import signal
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EXIT_SIGNAL = {signal.SIGTERM: 143, signal.SIGUSR1: 138, signal.SIGUSR2: 140, signal.SIGINT: 130}


class TrainingInterrupted(RuntimeError):
    """A stop signal arrived; a checkpoint was saved. ``exit_code`` = 128 + signum."""

    def __init__(self, signum: int, path: Path | None) -> None:
        self.exit_code = EXIT_SIGNAL.get(signum, 128 + signum)
        name = signal.Signals(signum).name
        where = f"checkpoint saved at {path}" if path else "checkpoints disabled: nothing saved"
        super().__init__(f"{name} received: stopped at a step boundary, {where}")


class StopSignals:
    """Catches the stop signals (when ``enabled``: ``checkpoint.save_on_signal`` with
    checkpoints on) from construction until ``finish``; ``signum``: the first one this
    rank saw, or that the ranks agreed another rank saw (agreement.py)."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.signum: int | None = None
        self._old_handlers: dict[int, Any] = {}
        if enabled:
            for signum in EXIT_SIGNAL:
                with contextlib.suppress(ValueError):  # not the main thread: no handlers
                    self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum  # acted on at the next agreed step boundary
        elif signum == signal.SIGINT:  # a second Ctrl-C: stop now, without saving
            signal.default_int_handler(signum, frame)

    @property
    def seen(self) -> bool:
        """A stop signal was seen on this rank, or agreed on (local: no collective)."""
        return self.signum is not None

    def finish(self, *, stopped: bool, saved: Path | None) -> None:
        """After the loop and its last checkpoint: restore the previous handlers;
        when the ranks agreed on a stop (``stopped``: every rank alike), run the
        previous handler (submitit requeues the job) and raise TrainingInterrupted
        naming the checkpoint ``saved``. A signal after that agreement finds the run
        done: nothing is left to stop."""
        try:
            if stopped and self.signum is not None:
                self._hand_signal_on()
                raise TrainingInterrupted(self.signum, saved)
        finally:
            for signum, handler in self._old_handlers.items():
                signal.signal(signum, handler)
            self._old_handlers = {}

    def _hand_signal_on(self) -> None:
        """Run the handler that was there before ours, if it is Python code:
        under submitit it requeues the job (on rank 0; other ranks only log) or,
        out of requeues, fails it."""
        handler = self._old_handlers.get(self.signum)
        if callable(handler) and handler is not signal.default_int_handler:
            log.info(f"passing {signal.Signals(self.signum).name} on to {handler.__qualname__}")
            handler(self.signum, None)
