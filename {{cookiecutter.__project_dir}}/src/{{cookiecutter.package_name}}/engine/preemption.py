"""Stop signals: the handlers, the stop decision (``poll_stop``), the hand-on to a
handler installed before ours (submitit's requeue), and the exit codes.

SIGTERM, SIGUSR1, SIGUSR2 and Ctrl-C set a flag; at the next step boundary the
run saves a checkpoint and exits with 128 + signal number (143, 138, 140, 130).
A second Ctrl-C stops at once. README: "Checkpoints and resuming".

One process: the flag is read at every step boundary. Several: a signal may
reach one rank only, so the ranks agree in an all-reduce, and never one of its
own per step: with ``trainer.on_nan=skip`` the flag rides along the step's NaN
all-reduce (every step); with ``on_nan=stop`` it rides along the loss guard's
check at log steps (every ``every_n_steps``, ``trainer.log_every_n_steps``),
so a stop takes effect at most ``every_n_steps - 1`` steps after the signal.
"""

import contextlib
import logging
import signal
from pathlib import Path
from typing import Any

import torch

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
    """Catches the stop signals (when ``enabled``: ``checkpoint.save_on_signal``
    with checkpoints on) from construction until ``finish``."""

    def __init__(
        self, *, accelerator: Any, enabled: bool, guard: Any = None, every_n_steps: int = 1
    ) -> None:
        self.accelerator = accelerator
        self.enabled = enabled
        self.signum: int | None = None  # the first signal seen (any rank, once polled)
        self.every_n_steps = every_n_steps
        self.guard = guard  # a LossGuard whose all-reduces carry the flag
        if guard is not None:
            guard.signal = lambda: self.signum or 0
        self._old_handlers: dict[int, Any] = {}
        if enabled:
            for signum in EXIT_SIGNAL:
                with contextlib.suppress(ValueError):  # not the main thread: no handlers
                    self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum  # acted on at the next step boundary
        elif signum == signal.SIGINT:  # a second Ctrl-C: stop now, without saving
            signal.default_int_handler(signum, frame)

    def poll_stop(self, step: int, *, final: bool = False) -> bool:
        """Should the run stop at this step boundary? True once a stop signal
        reached any rank. Under several processes every rank calls it once per
        step, at the same place in the loop; the ranks agree at most once per
        step (module docstring): from the guard's all-reduce of this step, or,
        every ``every_n_steps`` steps without one (and when ``final``: after the
        loop, so that every rank agrees on how it ended), an all-reduce of its own."""
        if not self.enabled:
            return False  # no handlers on any rank: a signal stops the process itself
        if self.accelerator.num_processes == 1:
            return self.signum is not None
        guard = self.guard
        if not final and guard is not None and (guard.mode == "skip" or guard.agreed_step == step):
            flag = guard.peer_signal  # agreed in this step's NaN all-reduce
        elif final or step % self.every_n_steps == 0:
            flag = torch.tensor([self.signum or 0], device=self.accelerator.device)
            flag = int(self.accelerator.reduce(flag, "max"))  # a signal may reach one rank only
        else:
            return False  # agreed on only every every_n_steps steps: the same on every rank
        if flag and self.signum is None:
            self.signum = flag
        return bool(flag)

    @property
    def stopped(self) -> bool:
        """A stop signal was seen on this rank (local: no collective)."""
        return self.signum is not None

    def finish(self, *, saved: Path | None) -> None:
        """After the loop and its last checkpoint: restore the previous handlers;
        after a stop signal, run the previous handler (submitit requeues the job)
        and raise TrainingInterrupted naming the checkpoint ``saved``."""
        try:
            if self.signum is not None:
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
