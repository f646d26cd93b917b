"""Logging of the processes of a run: with several, every rank logs to its own
file in the run dir and rank 0 also to the console. README: "The run directory".
"""

import logging
import os
import sys
from pathlib import Path

from .launch import global_rank

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - rank %(rank)s - %(message)s"


def setup_rank_logging(run_dir: Path) -> None:
    """With several processes: every rank logs to a file in the run dir
    (``train.log`` for rank 0, ``train_rank{r}.log`` for the others), and only
    rank 0 to the console. A single process keeps Hydra's logging as it is."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return
    rank = global_rank()
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
        handler.close()
    name = "train.log" if rank == 0 else f"train_rank{rank}.log"
    handlers: list[logging.Handler] = [logging.FileHandler(run_dir / name)]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    formatter = logging.Formatter(LOG_FORMAT.replace("%(rank)s", str(rank)))
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("accelerate").setLevel(logging.WARNING)
