"""Logging to the run directory: ``train.log`` (rank 0) and ``train_rank{r}.log``.

Hydra opens its job log file before our code runs, which would append to (or
create) ``train.log`` in a directory that may belong to another run. Our
``hydra.job_logging`` uses ``RunLogHandler`` instead: it holds the records in
memory until ``run_dir.claim`` has decided the directory is this run's, then
writes them to the file; a refused directory is never touched.
"""

import contextlib
import logging
import os
import sys
from pathlib import Path

from .launch import global_rank

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - rank %(rank)s - %(message)s"


class RunFileHandler(logging.FileHandler):
    """A log file's handler whose records, when the file cannot be written (a full or
    read-only disk), go to stderr instead: a failure that cannot write its own report
    still says it, with one line saying why, never logging's own traceback."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            super().handleError(record)
            return
        with contextlib.suppress(Exception):  # stderr is the last resort: nothing after it
            if not self.failed:
                why = err.strerror or err
                print(f"{self.baseFilename} cannot be written ({why}): on stderr", file=sys.stderr)
            self.failed = True
            print(self.format(record), file=sys.stderr, flush=True)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # what the full disk refused: said already
            super().close()


class RunLogHandler(logging.Handler):
    """A FileHandler that opens its file only when told (``open_run_logs``).
    Until then it keeps the records (a few lines: config checks, the claim)."""

    def __init__(self, filename: str, mode: str = "a", encoding: str | None = None) -> None:
        super().__init__()
        self.path, self.mode, self.encoding = Path(filename), mode, encoding
        self._pending: list[logging.LogRecord] = []
        self._file: logging.FileHandler | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self._file is not None:
            self._file.emit(record)
        else:
            self._pending.append(record)

    def open(self) -> None:
        self._file = RunFileHandler(self.path, self.mode, self.encoding)
        self._file.setFormatter(self.formatter)
        for record in self._pending:
            self._file.emit(record)
        self._pending.clear()

    def close(self) -> None:
        self._pending.clear()
        if self._file is not None:
            self._file.close()
        super().close()


def open_run_logs() -> None:
    """The run dir is ours: start writing ``train.log`` (what was held, then the rest)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, RunLogHandler) and handler._file is None:
            handler.open()


def discard_run_logs() -> None:
    """The run dir is not ours (or stays untouched): never write the held records."""
    root = logging.getLogger()
    for handler in root.handlers[:]:
        if isinstance(handler, RunLogHandler) and handler._file is None:
            root.removeHandler(handler)
            handler.close()


def setup_rank_logging(run_dir: Path, *, files: bool = True) -> None:
    """With several processes: every rank logs to a file in the run dir
    (``train.log`` for rank 0, ``train_rank{r}.log`` for the others), and only
    rank 0 to the console. A single process keeps Hydra's logging as it is.
    ``files=False``: the console only (a finished run's dir stays as it is)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        if files:
            open_run_logs()
        return
    rank = global_rank()
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
        handler.close()
    name = "train.log" if rank == 0 else f"train_rank{rank}.log"
    handlers: list[logging.Handler] = [RunFileHandler(run_dir / name)] if files else []
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    formatter = logging.Formatter(LOG_FORMAT.replace("%(rank)s", str(rank)))
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("accelerate").setLevel(logging.WARNING)
