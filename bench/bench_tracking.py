"""What logging costs: training steps/s with ``tracker=none`` against
``tracker=[csv,tensorboard]`` (or ``--trackers``).

    python bench/bench_tracking.py --project DIR          # 5 pairs of 1000-step runs
    python bench/bench_tracking.py --project DIR --trackers '[csv,tensorboard,wandb]' --steps 3000
    python bench/bench_tracking.py --project DIR --threads 1   # steadier on a shared machine

Two measurements:

- end to end: the real ``train.py`` in a subprocess, the same config for both
  (logging every ``trainer.log_every_n_steps``, default 10; no checkpoints; one
  evaluation at the end); steps/s from its ``summary.json`` (the training loop
  only: start-up and tracker start excluded). Runs alternate between the two
  settings so that a change in machine load hits both; the ratio is of medians.
  On a busy machine the run-to-run noise can be larger than the effect.
- direct: the same trackers, built from the same config, timed over many log
  calls of the six values train.py logs every ``log_every_n_steps``; with the
  steps/s of ``tracker=none`` this gives the share of training time spent
  logging, which other load on the machine hardly changes.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_project

TRAIN_METRICS = ("train/loss", "train/lr", "train/grad_norm", "train/epoch")
TRAIN_METRICS += ("perf/steps_per_sec", "perf/samples_per_sec")


def steps_per_sec(
    run_dir: Path, steps: int, tracker: str, extra: list[str], env: dict[str, str]
) -> float:
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", f"tracker={tracker}"]
    cmd += [f"trainer.max_steps={steps}", f"trainer.eval_every_n_steps={steps}"]
    cmd += ["checkpoint=none", *extra]
    proc = subprocess.run(cmd, cwd=bench_project.root(), capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())["steps_per_sec"]


def seconds_per_log_call(tracker: str, run_dir: Path, calls: int = 2000) -> tuple[float, int]:
    """Mean time of ``accelerator.log`` with the trackers of ``tracker=...``,
    and the config's log_every_n_steps."""
    from accelerate import Accelerator
    from hydra import compose, initialize_config_dir

    config = bench_project.module("engine.config")
    build_trackers = bench_project.module("engine.tracking").build_trackers
    root = bench_project.root()
    run_dir.mkdir(parents=True, exist_ok=True)
    config.register_resolvers(root)
    with initialize_config_dir(config_dir=str(root / "configs"), version_base="1.3"):
        overrides = [f"tracker={tracker}", "checkpoint=none"]
        cfg = config.resolve_config(compose("train", overrides=overrides))
    accelerator = Accelerator(
        cpu=True, log_with=build_trackers(cfg, run_dir) or None, project_dir=str(run_dir)
    )
    accelerator.init_trackers(cfg.project)
    values = {name: 0.5 + i for i, name in enumerate(TRAIN_METRICS)}
    start = time.perf_counter()
    for step in range(calls):
        accelerator.log(values, step=step)
    elapsed = (time.perf_counter() - start) / calls
    accelerator.end_training()
    return elapsed, cfg.trainer.log_every_n_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_project.add_option(parser)
    parser.add_argument("--trackers", default="[csv,tensorboard]")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the runs go (removed)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads per run")
    parser.add_argument("overrides", nargs="*", help="more train.py overrides")
    args = parser.parse_args()
    bench_project.use_option(parser, args)
    rates: dict[str, list[float]] = {"none": [], args.trackers: []}
    env = dict(os.environ)
    if args.threads:  # threads competing with other load for few cores slow down erratically
        env["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for i in range(args.repeats):
            for j, tracker in enumerate(rates):
                run_dir = Path(tmp) / f"{i}-{j}"
                rate = steps_per_sec(run_dir, args.steps, tracker, args.overrides, env)
                rates[tracker].append(rate)
        per_call, every = seconds_per_log_call(args.trackers, Path(tmp) / "direct")
    for tracker, values in rates.items():
        shown = " ".join(f"{v:.1f}" for v in values)
        print(f"tracker={tracker:<24} median {statistics.median(values):8.1f} steps/s ({shown})")
    none = statistics.median(rates["none"])
    print(
        f"direct: one log call of {len(TRAIN_METRICS)} values costs {per_call * 1e6:.0f} us; "
        f"every {every} steps at {none:.0f} steps/s that is "
        f"{100 * per_call * none / every:.2f} % of the training time"
    )
    ratio = statistics.median(rates[args.trackers]) / none
    print(f"ratio {args.trackers} / none: {ratio:.4f}")


if __name__ == "__main__":
    main()
