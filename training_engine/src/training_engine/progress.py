"""Progress on the main process: a tqdm bar on a terminal, plain log lines
otherwise (files, CI, SLURM logs). Both show steps/s, samples/s, tokens/s (token
tasks), MFU (when the model declares its FLOPs, see ``throughput.py``) and the
ETA. And the run's clock, which keeps evaluation and checkpoint time apart.

Every rate is over the same window (the log steps since the previous one) and
training time only: time in ``RunClock.excluded`` blocks (evaluation, the part
of a checkpoint save that blocks training) is left out and reported on its
own, as ``perf/eval_s`` and ``perf/ckpt_blocking_s`` (seconds, whole run).
docs/run-dir.md."""

import contextlib
import datetime
import logging
import sys
import time
from typing import Any

from accelerate import PartialState
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, total_steps: int, initial_step: int = 0, clock: "RunClock | None" = None):
        self.total = total_steps
        self.clock = clock or RunClock()
        main = PartialState().is_main_process
        self.log_lines = main
        self.bar = tqdm(
            total=total_steps,
            initial=initial_step,
            unit="step",
            dynamic_ncols=True,
            disable=not (main and sys.stderr.isatty()),
        )
        self._start = self._mark = self.clock.training_s()
        self._start_step = self._mark_step = initial_step
        self._wall_start = time.perf_counter()

    def on_step_end(self, run: Any) -> None:
        """The loop's event (callbacks.py): a step was taken."""
        self.advance()

    def advance(self) -> None:
        self.bar.update(1)

    def window_rate(self, step: int) -> float:
        """Steps per second of training time since the previous call (or the start)."""
        now = self.clock.training_s()
        rate = (step - self._mark_step) / max(now - self._mark, 1e-9)
        self._mark, self._mark_step = now, step
        return rate

    def report(self, step: int, metrics: dict[str, float]) -> None:
        """Show ``metrics`` on the bar, and as a log line (file and non-TTY console).
        The rates shown are the ``perf/*`` of the log step (one window); the ETA
        uses the attempt's wall time so far (evaluations and saves included)."""
        if self.bar.disable and not self.log_lines:  # another rank: nothing to show
            return
        done = step - self._start_step
        wall = time.perf_counter() - self._wall_start
        left = (self.total - step) * wall / done if done > 0 else None
        eta = datetime.timedelta(seconds=round(left)) if left is not None else "?"
        shown = {k: f"{v:.4g}" for k, v in metrics.items() if not k.startswith("perf/")}
        rates = []  # one window, training time only (module docstring)
        if "perf/samples_per_sec" in metrics:
            rates.append(f"{metrics['perf/samples_per_sec']:.0f} samples/s")
        if "perf/tokens_per_sec" in metrics:
            rates.append(f"{metrics['perf/tokens_per_sec']:.0f} tokens/s")
        if "perf/mfu" in metrics:
            rates.append(f"mfu {metrics['perf/mfu']:.1%}")
        if "perf/steps_per_sec" in metrics:
            rates.append(f"{metrics['perf/steps_per_sec']:.1f} steps/s")
        self.bar.set_postfix(shown, refresh=False)
        if self.log_lines:
            fields = " | ".join([*(f"{k} {v}" for k, v in shown.items()), *rates])
            line = f"step {step}/{self.total} | {fields} | eta {eta}"
            if self.bar.disable:  # no bar to print around (no terminal): ~0.25 ms less
                log.info(line)
            else:
                with logging_redirect_tqdm():  # print above the bar, not through it
                    log.info(line)

    def close(self) -> None:
        self.bar.close()


class RunClock:
    """Training time of the whole run, across resumes: checkpoints save it
    (``trainer_state.json``), so ``summary.json`` reports the run, not the last
    attempt. It runs from ``start()`` (the loop); time spent after the last
    checkpoint of an interrupted attempt is redone by the next one, and counted there."""

    KINDS = ("eval", "ckpt_blocking")

    def __init__(self) -> None:
        self.before = 0.0  # seconds trained by earlier attempts
        self._started: float | None = None
        self.excluded_s = dict.fromkeys(self.KINDS, 0.0)  # whole run, across resumes

    def start(self) -> None:
        self._started = time.perf_counter()

    def elapsed(self) -> float:
        """Wall time of the whole run (every attempt, from the loop's start)."""
        running = time.perf_counter() - self._started if self._started is not None else 0.0
        return self.before + running

    def training_s(self) -> float:
        """``elapsed`` without the time in ``excluded`` blocks."""
        return self.elapsed() - sum(self.excluded_s.values())

    @contextlib.contextmanager
    def excluded(self, kind: str):
        """Time spent in this block is not training time: counted under ``kind``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.excluded_s[kind] += time.perf_counter() - started

    def metrics(self) -> dict[str, float]:
        """``perf/eval_s`` and ``perf/ckpt_blocking_s``: seconds so far, whole run."""
        return {f"perf/{kind}_s": value for kind, value in self.excluded_s.items()}

    def state_dict(self) -> dict[str, float]:
        return {"train_s": self.elapsed(), **{f"{k}_s": v for k, v in self.excluded_s.items()}}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.before = float(state["train_s"])
        for kind in self.KINDS:  # absent in checkpoints from before issue 18
            self.excluded_s[kind] = float(state.get(f"{kind}_s", 0.0))
