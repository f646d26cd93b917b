"""``python engine_tests/train_with_faults.py OVERRIDES``: train.py with the checkpoint
pause points of ``CKPT_TEST_PAUSE_AT=POINT[@STEP][+SECONDS]`` switched on.

A save reaching POINT (between_files, before_rename, before_pointers, pruning, or
final_weights: the run's model.safetensors; at STEP, or the first time) prints
``CKPT_TEST_PAUSED POINT step N`` and sleeps (SECONDS, else an hour), so a test can
SIGKILL the process exactly there. The hook is installed when this file is
imported, so spawned DDP workers (which import the parent's main script) have it
too; production code only carries the no-op ``checkpoint.save.pause_point``.
"""

import os
import sys
import time
from pathlib import Path

from training_engine.checkpoint import save as checkpoint_save

# The project under test (engine_tests/conftest.py): its train.py.
TRAIN = Path(os.environ.get("TRAINING_ENGINE_PROJECT") or Path.cwd()) / "train.py"


def pause_point(point: str, step: int | None = None) -> None:
    wanted = os.environ.get("CKPT_TEST_PAUSE_AT")
    if not wanted:
        return
    where, _, seconds = wanted.partition("+")
    name, _, at = where.partition("@")
    if name == point and (not at or int(at) == step):
        print(f"CKPT_TEST_PAUSED {point} step {step}", file=sys.stderr, flush=True)
        time.sleep(float(seconds or 3600))


checkpoint_save.pause_point = pause_point

# train.py's code runs in this module's namespace: its functions belong to this
# main module, so spawned workers (which import it as __mp_main__) find them
# after installing the hook above; train.py's own __main__ guard starts the run.
exec(compile(TRAIN.read_text(), str(TRAIN), "exec"))
