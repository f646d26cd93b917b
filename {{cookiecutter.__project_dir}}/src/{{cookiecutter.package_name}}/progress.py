"""Progress on the main process: a tqdm bar on a terminal, plain log lines
otherwise (files, CI, SLURM logs). Both show steps/s, samples/s, MFU (when
the model declares its FLOPs, see ``throughput.py``) and the ETA."""

import datetime
import logging
import sys
import time

from accelerate import PartialState
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, total_steps: int, initial_step: int = 0) -> None:
        self.total = total_steps
        main = PartialState().is_main_process
        self.log_lines = main
        self.bar = tqdm(
            total=total_steps,
            initial=initial_step,
            unit="step",
            dynamic_ncols=True,
            disable=not (main and sys.stderr.isatty()),
        )
        self._start = self._mark = time.perf_counter()
        self._start_step = self._mark_step = initial_step

    def advance(self) -> None:
        self.bar.update(1)

    def window_rate(self, step: int) -> float:
        """Steps per second since the previous call (or since the start)."""
        now = time.perf_counter()
        rate = (step - self._mark_step) / max(now - self._mark, 1e-9)
        self._mark, self._mark_step = now, step
        return rate

    def overall_rate(self, step: int) -> float:
        return (step - self._start_step) / max(time.perf_counter() - self._start, 1e-9)

    def report(self, step: int, metrics: dict[str, float]) -> None:
        """Show ``metrics`` on the bar, and as a log line (file and non-TTY console)."""
        rate = self.overall_rate(step)
        eta = datetime.timedelta(seconds=round((self.total - step) / rate)) if rate > 0 else "?"
        shown = {k: f"{v:.4g}" for k, v in metrics.items() if not k.startswith("perf/")}
        if "perf/samples_per_sec" in metrics:
            shown["samples/s"] = f"{metrics['perf/samples_per_sec']:.0f}"
        if "perf/mfu" in metrics:
            shown["mfu"] = f"{metrics['perf/mfu']:.1%}"
        self.bar.set_postfix(shown, refresh=False)
        if self.log_lines:
            fields = " | ".join(
                f"{v} {k}" if k == "samples/s" else f"{k} {v}" for k, v in shown.items()
            )
            with logging_redirect_tqdm():  # print above the bar, not through it
                log.info(f"step {step}/{self.total} | {fields} | {rate:.1f} steps/s | eta {eta}")

    def close(self) -> None:
        self.bar.close()


class RunClock:
    """Training time of the whole run, across resumes: checkpoints save it
    (``trainer_state.json``), so ``summary.json`` reports the run, not the last
    attempt. It runs from ``start()`` (the loop); time spent after the last
    checkpoint of an interrupted attempt is redone by the next one, and counted there."""

    def __init__(self) -> None:
        self.before = 0.0  # seconds trained by earlier attempts
        self._started: float | None = None

    def start(self) -> None:
        self._started = time.perf_counter()

    def elapsed(self) -> float:
        running = time.perf_counter() - self._started if self._started is not None else 0.0
        return self.before + running

    def state_dict(self) -> dict[str, float]:
        return {"train_s": self.elapsed()}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.before = float(state["train_s"])
