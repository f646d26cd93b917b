"""What this project's infrastructure costs, measured against bare PyTorch in one run.

    python bench.py                          # every figure; a few minutes; prints a table
    python bench.py --quick                  # tiny sizes, 1 round (CI: printed, not judged)
    python bench.py --json bench.json        # also write the figures, settings and machine
    python bench.py --only checkpoint        # some parts: loop, ddp, startup, checkpoint, log, step
    python bench.py --only ckpt_memory       # peak memory per rank: full vs sharded (FSDP, 2 ranks)
    python bench.py --trackers csv,tensorboard --repeats 7
    python bench.py --overrides model=mlp data=digits    # another workload (Hydra overrides)

Each figure is a ratio of medians over ``--repeats`` rounds. Within a round the
two sides run back to back, alternating which goes first, so a drift in machine
load hits both alike. Timings come from a global optimizer-step hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``) installed in both
processes, so neither side measures itself differently.

==================  =====================================================================  ======
figure              ours / the baseline                                                    goal
==================  =====================================================================  ======
loop_ratio          steps/s of ``python train.py`` (defaults: its tracker, log lines every  >= 0.98
                    10 steps, checkpoints every 500 steps; evaluation only after the timed
                    steps) / a bare hand-written loop on the same model, data loader,
                    batch, optimizer, schedule, clipping and precision
ddp_loop_ratio      the same with 2 processes: ``torchrun train.py parallel=ddp`` / a bare  >= 0.97
                    DDP loop (gloo on a CPU, NCCL on GPUs), steps/s of rank 0
first_step_ratio    process start -> first optimizer step done: ``python train.py`` / a     <= 1.2
                    bare script that imports torch, builds the model and data, one step
process_ratio       the whole process (start to exit) of those two runs                     <= 1.2
preflight_share     preflight's seconds on the example task (``train.py`` defaults) / the   <= 1.0
                    larger of 1 s and 2 % of its own ETA
save_ratio          our save (atomic protocol, xxh3 checksums, fsync, manifest, pointers,   <= 1.10
                    pruning) / one ``torch.save`` + fsync of the same state to the same
                    disk (``save_vs_raw_ratio``: against torch.save without fsync)
load_ratio          our load (every checksum verified, weights_only, applied) /             <= 1.15
                    torch.load + load_state_dict of the same state
async_block_ratio   time ``save`` blocks training with ``checkpoint.async=true`` / without  <= 0.25
log_overhead        1 - steps/s with ``tracker=[--trackers]`` / with ``tracker=none``:      <= 0.01
                    in one process, the loop's step and log step (every 10 steps) in
                    alternating blocks with and without ``accelerator.log``
step_ratio          one optimizer step, in one process: the bare step / the loop's own      >= 0.98
                    (``state.optimizer_step`` through accelerate, the NaN guard, the
                    prepared loader), in alternating blocks: the per-step cost without
                    the between-process drift of a shared machine
==================  =====================================================================  ======

``--only startup`` also lists the fixed costs of a start one by one (interpreter,
imports, Hydra, the accelerator, preflight). ``--quick`` (CI) runs every part
at tiny sizes, one round, the log figure from the default run: every figure is
printed, none is judged.

The default workload is the GPT example (``model=gpt data=tokens``): small on a
CPU, its configured size with bf16 on a GPU. With ``trainer.compile=true`` in
``--overrides`` both sides compile. Timings on a busy machine are noisy: compare
ratios from one run, not across machines.
"""

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
GOALS = {  # figure: (comparison, goal, the baseline it is measured against)
    "loop_ratio": (">=", 0.98, "a bare hand-written loop, steps/s"),
    "ddp_loop_ratio": (">=", 0.97, "a bare 2-process DDP loop, steps/s"),
    "first_step_ratio": ("<=", 1.2, "a bare script's time to its first step"),
    "process_ratio": ("<=", 1.2, "a bare script's whole process"),
    "preflight_share": ("<=", 1.0, "max(1 s, 2 % of the example's ETA)"),
    "save_ratio": ("<=", 1.10, "torch.save + fsync"),
    "load_ratio": ("<=", 1.15, "torch.load + load_state_dict"),
    "async_block_ratio": ("<=", 0.25, "our synchronous save"),
    "log_overhead": ("<=", 0.01, "tracker=none, same process, alternating"),
    "step_ratio": (">=", 0.98, "the bare step, same process, alternating"),
}
PARTS = ("loop", "ddp", "startup", "checkpoint", "log", "step")
CHILDREN = ROOT / "scripts" / "bench_children.py"  # the timed processes
sys.path.insert(0, str(ROOT / "scripts"))
from bench_checkpoint import bench_checkpoint  # noqa: E402 (the checkpoint figures, in-process)
from bench_ckpt_memory import bench_ckpt_memory  # noqa: E402 (full vs sharded, 2 FSDP ranks)
from bench_step import bench_step  # noqa: E402 (the step alone: ours vs bare, in-process)

EXTRA_PARTS = ("ckpt_memory",)  # only when named in --only

GPT = ["model=gpt", "data=tokens"]
SIZES = {  # workload sizes per setting; override any with --overrides
    "quick": [
        "data.seq_len=32",
        "data.vocab_size=64",
        "data.num_train=512",
        "data.batch_size=16",
        "model.d_model=64",
        "model.n_layer=2",
        "model.n_head=2",
    ],
    "cpu": [  # ~20-50 ms per step on a laptop core
        "data.seq_len=32",
        "data.vocab_size=64",
        "data.num_train=2048",
        "data.batch_size=16",
        "model.d_model=64",
        "model.n_layer=2",
        "model.n_head=2",
    ],
    "gpu": ["trainer.mixed_precision=bf16"],  # the configured size
}
# A bigger model for the checkpoint figures, so that they measure bytes, not
# per-file overheads (quick: the workload's own model).
CHECKPOINT_SIZE = {  # ~20M parameters: ~250 MB with AdamW's state
    "cpu": ["model.d_model=512", "model.n_layer=6", "model.n_head=8"],
    "gpu": ["model.d_model=512", "model.n_layer=6", "model.n_head=8"],
}


# --- running the timed processes (scripts/bench_children.py) ---------------------------------


def _run_child(kind: str, spec: dict, work: Path, ddp: bool = False) -> dict:
    """Run one training process (``ddp``: 2 under torchrun); return rank 0's
    steps/s after the warm-up, its time to the first step and the whole
    process's wall time."""
    out = work / f"{kind}-{time.monotonic_ns()}.json"
    spec = {**spec, "out": str(out), "ddp": ddp}
    spec_path = out.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    launcher = [sys.executable]
    if ddp:
        torchrun = Path(sys.executable).with_name("torchrun")
        launcher = [str(torchrun), "--standalone", "--nproc_per_node", "2"]
        out = out.with_name(out.name + ".rank0")
    started = time.time()
    proc = subprocess.run(
        [*launcher, str(CHILDREN), kind, str(spec_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    process_s = time.time() - started
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"bench: the {kind} process failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(out.read_text())
    times = result["times"]
    if len(times) != spec["steps"]:
        raise SystemExit(f"bench: {kind} took {len(times)} optimizer steps, not {spec['steps']}")
    skip = spec["warmup"]
    return {
        "steps_per_sec": (len(times) - 1 - skip) / (times[-1] - times[skip]),
        "first_step_s": result["first_step_at"][0] - started,
        "process_s": process_s,
    }


# --- the parts --------------------------------------------------------------------------------


def compose(overrides: list[str]) -> dict:
    """The resolved config ``python train.py OVERRIDES`` would run, as plain data."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from {{ cookiecutter.package_name }}.config import register_resolvers, resolve_config

    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = hydra_compose("train", overrides=overrides)
    return OmegaConf.to_container(resolve_config(cfg), resolve=True)


def _alternate(
    args, variants: dict, overrides: list[str], config: dict, work: Path, ddp: bool = False
) -> dict[str, list[dict]]:
    """``args.repeats`` rounds of every variant of ours (train.py with
    ``overrides`` + its own) and the bare loop, alternating the order."""
    steps, warmup = args.steps, max(2, args.steps // 10)
    if any(o.startswith("trainer.compile=true") for o in overrides):
        warmup = max(warmup, args.steps // 3)  # compiling takes the first steps
    runs: dict[str, list[dict]] = {name: [] for name in [*variants, "bare"]}
    for round_ in range(args.repeats):
        order = [*variants, "bare"]
        if round_ % 2:
            order.reverse()
        for name in order:
            spec = {"steps": steps, "warmup": warmup}
            if name == "bare":
                result = _run_child("bare", {**spec, "config": config}, work, ddp)
            else:
                run_dir = work / f"run-{len(os.listdir(work))}"
                spec["overrides"] = [*overrides, *variants[name], f"hydra.run.dir={run_dir}"]
                result = _run_child("train", spec, work, ddp)
                shutil.rmtree(run_dir, ignore_errors=True)
            runs[name].append(result)
            print(
                f"  round {round_ + 1}/{args.repeats} {name:<32} "
                f"{result['steps_per_sec']:8.2f} steps/s, first step after "
                f"{result['first_step_s']:.2f} s, process {result['process_s']:.2f} s",
                flush=True,
            )
    return runs


def bench_loops(args, overrides: list[str], work: Path, results: dict) -> None:
    """Ours (train.py with its defaults) and bare in alternation."""
    steps = args.steps
    common = [
        f"trainer.max_steps={steps}",
        f"trainer.eval_every_n_steps={steps}",  # evaluate once, after the timed steps
        "trainer.log_every_n_steps=10",
        "preflight=off",  # its checks run real steps before the loop: timed on their own
    ]
    config = compose([*overrides, *common])
    runs = _alternate(args, {"ours": []}, [*overrides, *common], config, work)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    if "loop" in args.only:
        results["loop_ratio"] = med("ours", "steps_per_sec") / med("bare", "steps_per_sec")
        results["ours_steps_per_sec"] = med("ours", "steps_per_sec")
        results["bare_steps_per_sec"] = med("bare", "steps_per_sec")
    if "startup" in args.only:
        results["first_step_ratio"] = med("ours", "first_step_s") / med("bare", "first_step_s")
        results["ours_first_step_s"] = med("ours", "first_step_s")
        results["bare_first_step_s"] = med("bare", "first_step_s")
        results["process_ratio"] = med("ours", "process_s") / med("bare", "process_s")
        results["ours_process_s"] = med("ours", "process_s")
        results["bare_process_s"] = med("bare", "process_s")


def bench_ddp(args, overrides: list[str], work: Path, results: dict) -> None:
    """2-process DDP: ``torchrun train.py parallel=ddp`` against a bare DDP loop."""
    common = [
        "parallel=ddp",
        f"trainer.max_steps={args.steps}",
        f"trainer.eval_every_n_steps={args.steps}",
        "trainer.log_every_n_steps=10",
        "preflight=off",
    ]
    config = compose([*overrides, *common])
    runs = _alternate(args, {"ours, ddp": []}, [*overrides, *common], config, work, ddp=True)
    ours = statistics.median(r["steps_per_sec"] for r in runs["ours, ddp"])
    bare = statistics.median(r["steps_per_sec"] for r in runs["bare"])
    results["ddp_loop_ratio"] = ours / bare
    results["ddp_ours_steps_per_sec"], results["ddp_bare_steps_per_sec"] = ours, bare


def bench_startup(args, work: Path, results: dict) -> None:
    """The fixed costs of a start of ``python train.py`` (the defaults: the
    example task) one by one in a fresh process, then its preflight there."""
    costs: list[dict] = []
    for round_ in range(args.repeats):
        out, run_dir = work / f"startup-{round_}.json", work / f"preflight-{round_}"
        spec = {"out": str(out), "overrides": [], "run_dir": str(run_dir)}
        spec_path = out.with_suffix(".spec.json")
        spec_path.write_text(json.dumps({**spec, "launched_at": time.time()}))
        cmd = [sys.executable, str(CHILDREN), "startup", str(spec_path)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        log_text = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
        took = re.search(r"preflight \(([\d.]+) s\)", log_text)
        if proc.returncode != 0 or took is None or not out.exists():
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise SystemExit(f"bench: the start-up process failed:\n{tail}")
        cost = json.loads(out.read_text())
        cost["preflight (example task, defaults)"] = float(took.group(1))
        eta = json.loads((run_dir / "preflight.json").read_text())["estimates"]["eta_s"]
        cost["eta"] = eta or 0.0
        costs.append(cost)
        shutil.rmtree(run_dir, ignore_errors=True)
    fixed = {name: statistics.median(c[name] for c in costs) for name in costs[0]}
    eta = fixed.pop("eta")
    print("  fixed costs of a start of train.py with the defaults (median):")
    for name, seconds in fixed.items():
        print(f"    {name:<44} {seconds * 1000:8.0f} ms")
    print(f"    {'total':<44} {sum(fixed.values()) * 1000:8.0f} ms")
    preflight = fixed["preflight (example task, defaults)"]
    allowed = max(1.0, 0.02 * eta)
    print(f"  preflight {preflight:.2f} s; allowed max(1 s, 2 % of its ETA {eta:.0f} s)")
    results["preflight_share"] = preflight / allowed
    results["startup_costs_s"] = fixed


# --- report -----------------------------------------------------------------------------------


def machine() -> dict:
    import torch

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "device": "cpu",
    }
    if torch.cuda.is_available():
        info["device"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return info


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def report(results: dict) -> None:
    print(f"\n{'figure':<20} {'value':>8}   {'goal':<8} {'':<8} baseline")
    for name, (op, goal, baseline) in GOALS.items():
        if name not in results:
            continue
        value = results[name]
        met = value >= goal if op == ">=" else value <= goal
        verdict = "met" if met else "NOT MET"
        print(f"{name:<20} {value:8.3f}   {op} {goal:<5} {verdict:<8} {baseline}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round (for CI)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--repeats", type=int, help="rounds (default 5; quick: 1)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (200; quick: 12)")
    parser.add_argument(
        "--only", default=",".join(PARTS), help=f"comma-separated parts of {','.join(PARTS)}"
    )
    parser.add_argument(
        "--trackers",
        default=None,
        help="trackers for log_overhead (default: csv, and tensorboard when it is available)",
    )
    parser.add_argument(
        "--overrides", nargs="*", default=None, help="Hydra overrides: the workload to time"
    )
    parser.add_argument("--dir", type=Path, default=None, help="scratch space (default: ./)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.steps = args.steps or (12 if args.quick else 200)
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in args.only if p not in PARTS + EXTRA_PARTS]
    if bad:
        parser.error(f"--only {','.join(bad)}: choose from {', '.join(PARTS)}")
    if args.trackers is None:
        import importlib.util

        available = importlib.util.find_spec("tensorboard") is not None
        wanted = ["csv"] + (["tensorboard"] if available and not args.quick else [])
        args.trackers = [t for t in wanted if (ROOT / f"configs/tracker/{t}.yaml").exists()]
    else:
        args.trackers = [t.strip() for t in args.trackers.split(",") if t.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    where = "quick" if args.quick else ("gpu" if torch.cuda.is_available() else "cpu")
    overrides = args.overrides if args.overrides is not None else [*GPT, *SIZES[where]]
    work = Path(tempfile.mkdtemp(prefix="bench_", dir=args.dir or ROOT))
    results: dict = {}
    print(f"workload: {' '.join(overrides) or '(defaults)'}; {args.repeats} round(s)")
    print(f"load average before: {_load()} ({os.cpu_count()} CPUs)")
    try:
        if {"loop", "startup"} & set(args.only):
            print(
                f"training runs of {args.steps} steps (first {max(2, args.steps // 10)} untimed):"
            )
            (work / "loops").mkdir()
            bench_loops(args, overrides, work / "loops", results)
        if "ddp" in args.only:
            print(f"2-process DDP runs of {args.steps} steps:")
            (work / "ddp").mkdir()
            bench_ddp(args, overrides, work / "ddp", results)
        if "startup" in args.only:
            print("start-up:")
            (work / "startup").mkdir()
            bench_startup(args, work / "startup", results)
        if "checkpoint" in args.only:
            print("checkpoints:")
            size = [] if args.quick or args.overrides is not None else CHECKPOINT_SIZE[where]
            (work / "checkpoint").mkdir()
            config = compose([*overrides, *size])
            bench_checkpoint(args, config, work / "checkpoint", results)
        if {"step", "log"} & set(args.only):
            print("one optimizer step (and log step), ours and bare in alternating blocks:")
            (work / "step").mkdir()
            trackers = (
                f"tracker=[{','.join(args.trackers)}]" if "log" in args.only else "tracker=none"
            )
            config = compose(
                [*overrides, trackers, "trainer.log_every_n_steps=10", "parallel=none"]
            )
            bench_step(args, config, work / "step", results)
        if "ckpt_memory" in args.only:
            bench_ckpt_memory(args, compose, work, results)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results)
    print(f"load average after: {_load()}")
    if args.json:
        payload = {
            "figures": {k: results[k] for k in GOALS if k in results},
            "details": {k: v for k, v in results.items() if k not in GOALS},
            "goals": {k: f"{op} {goal}" for k, (op, goal, _) in GOALS.items()},
            "baselines": {k: baseline for k, (_, _, baseline) in GOALS.items()},
            "settings": {
                "quick": args.quick,
                "repeats": args.repeats,
                "steps": args.steps,
                "overrides": overrides,
                "trackers": args.trackers,
            },
            "machine": machine(),
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
