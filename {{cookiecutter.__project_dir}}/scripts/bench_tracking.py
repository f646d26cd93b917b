"""Training steps/s with ``tracker=none`` against ``tracker=[csv,tensorboard]``:
what logging costs.

    python scripts/bench_tracking.py                      # 5 pairs of 1000-step runs
    python scripts/bench_tracking.py --trackers '[csv,tensorboard,wandb]' --steps 3000

Each run is the real ``train.py`` in a subprocess with the same config (logging
every ``trainer.log_every_n_steps``, default 10; no checkpoints; one evaluation
at the end), and steps/s comes from its ``summary.json`` (the training loop
only: start-up and tracker start excluded). Runs alternate between the two
settings so that a change in machine load hits both; the ratio is of medians.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def steps_per_sec(run_dir: Path, steps: int, tracker: str, extra: list[str]) -> float:
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", f"tracker={tracker}"]
    cmd += [f"trainer.max_steps={steps}", f"trainer.eval_every_n_steps={steps}"]
    cmd += ["checkpoint=none", *extra]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())["steps_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trackers", default="[csv,tensorboard]")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the runs go (removed)")
    parser.add_argument("overrides", nargs="*", help="more train.py overrides")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"none": [], args.trackers: []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for i in range(args.repeats):
            for j, tracker in enumerate(rates):
                run_dir = Path(tmp) / f"{i}-{j}"
                rates[tracker].append(steps_per_sec(run_dir, args.steps, tracker, args.overrides))
    for tracker, values in rates.items():
        shown = " ".join(f"{v:.1f}" for v in values)
        print(f"tracker={tracker:<24} median {statistics.median(values):8.1f} steps/s ({shown})")
    ratio = statistics.median(rates[args.trackers]) / statistics.median(rates["none"])
    print(f"ratio {args.trackers} / none: {ratio:.4f}")


if __name__ == "__main__":
    main()
