"""The recipe on this project's own model and data: the defaults train and write the
run dir; a run killed with kill -9 mid-run and run again resumes and ends with the
same weights, bit for bit, as a run never interrupted. Keep these when you change
the model, the data or the task: they are what lets you trust a resumed run."""

import csv
import math
import os
import signal
from pathlib import Path

from training_engine.testing import checkpoint_differences, fingerprints

from .conftest import FAST, run_train

# Checkpoints every 10 steps of 40; the kill lands right after the one at step 20.
RESUMABLE = [
    "parallel=none",
    *FAST,
    "trainer.max_steps=40",
    "checkpoint.every_n_steps=10",
]


class KillOnce:
    """A callback (configs/callbacks/): SIGKILL its own process right after the
    checkpoint at ``step`` is written, once per run dir (the marker file)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step = step
        self.marker = Path(marker)

    def on_save(self, run, checkpoint: Path) -> None:
        if run.step == self.step and not self.marker.exists():
            self.marker.write_text(str(run.step))
            os.kill(os.getpid(), signal.SIGKILL)


def test_the_defaults_train_and_write_the_run_dir(tmp_path):
    run = run_train(tmp_path / "run", *FAST[1:], "trainer.max_steps=20")  # the bake's parallel
    summary = run.summary
    assert summary["step"] == 20 and summary["final_weights"]
    assert summary["metrics"] and all(math.isfinite(v) for v in summary["metrics"].values())
    assert (run.run_dir / "config.yaml").is_file()
    assert (run.run_dir / "model.safetensors").is_file()
    assert sorted((run.run_dir / "checkpoints").glob("step_*"))


def test_a_run_killed_mid_run_resumes_bit_for_bit(tmp_path):
    whole = run_train(tmp_path / "whole", *RESUMABLE)
    marker = tmp_path / "killed-once"
    kill = [
        "+callbacks.kill._target_=tests.test_recipe.KillOnce",
        "+callbacks.kill.step=20",
        f"+callbacks.kill.marker={marker}",
    ]
    killed = run_train(tmp_path / "killed", *RESUMABLE, *kill, check=False)
    assert killed.proc.returncode == -signal.SIGKILL, killed.output[-3000:]
    assert marker.read_text() == "20" and not (killed.run_dir / "summary.json").exists()
    resumed = run_train(tmp_path / "killed", *RESUMABLE, *kill)  # the same command, again
    assert resumed.summary["step"] == 40
    assert Path(resumed.summary["resumed_from"]) == killed.run_dir / "checkpoints" / "step_0000020"
    assert fingerprints(resumed.run_dir)["train.log"] == fingerprints(whole.run_dir)["train.log"], (
        f"resumed from {resumed.summary['resumed_from']}; "
        + first_logged_difference(resumed.run_dir, whole.run_dir)
        + "; checkpoints: "
        + checkpoint_differences(resumed.run_dir, whole.run_dir)
    )

    # and the metrics of the last evaluation, to the bit (not the timings)
    def measured(run):
        return {k: v for k, v in run.summary["metrics"].items() if not k.startswith("perf/")}

    assert measured(resumed) == measured(whole)


def first_logged_difference(run_dir: Path, other: Path) -> str:
    """The first (step, metric) whose logged value differs between two runs, timings
    aside: a resume that went wrong at once differs at its first log step after the
    checkpoint, one that drifted later at a later one."""

    def logged(folder: Path) -> dict:
        with open(folder / "metrics.csv", newline="") as f:
            rows = csv.DictReader(f)
            return {
                (int(r["step"]), r["name"]): r["value"]
                for r in rows
                if not r["name"].startswith("perf/")
            }

    ours, theirs = logged(run_dir), logged(other)
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            (step, name), values = key, (ours.get(key), theirs.get(key))
            return f"first logged difference: step {step}, {name}: {values[0]} != {values[1]}"
    return "every logged value is the same"
