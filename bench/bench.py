"""What a baked project's infrastructure costs, measured against bare PyTorch in one run.

    python bench/bench.py --project DIR            # every figure; a few minutes; prints a table
    python bench/bench.py --project DIR --quick    # tiny sizes, 1 round (CI: printed, not judged)
    python bench/bench.py --project DIR --json bench.json   # also the figures, settings, machine
    python bench/bench.py --project DIR --only checkpoint   # parts: loop, ddp, startup, checkpoint,
                                                            # log, step; ckpt_memory (FSDP, 2 ranks)
    python bench/bench.py --project DIR --trackers csv,tensorboard --repeats 7
    python bench/bench.py --project DIR --overrides model=mlp data=digits   # another workload

DIR is a project the template baked (``make bench`` bakes the defaults and runs this),
in an environment with its dependencies; the processes timed run its ``train.py``.

Each figure is a median over ``--repeats`` rounds. The loop figures run ours and
the bare loop at once, taking turns every 10 optimizer steps (bench_turns.py):
on a shared machine steps/s drifts by far more between two runs than these
figures judge, and in turns both sides see the same second of it. Start-up
figures run the two one after the other, alternating which goes first.
Timings come from a global optimizer-step hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``) installed in both
processes, so neither side measures itself differently.

==================  =====================================================================  ======
figure              ours / the baseline                                                    goal
==================  =====================================================================  ======
loop_ratio          steps/s of ``python train.py`` (defaults: its tracker, log lines every  >= 0.98
                    10 steps, checkpoints every 500 steps; evaluation only after the timed
                    steps) / a bare hand-written loop on the same model, data loader,
                    batch, optimizer, schedule, clipping, precision and CPU threads (pinned
                    as train.py pins them; ``thread_pin_cost``: what the pin costs the bare
                    loop, a third side in the same turns), in turns of 10 steps
ddp_loop_ratio      the same with 2 processes each: ``torchrun train.py parallel=ddp`` / a  >= 0.97
                    bare DDP loop (gloo on a CPU, NCCL on GPUs), in turns of 10 steps
first_step_ratio    process start -> first optimizer step done: ``python train.py`` / a     <= 1.1
                    bare script that imports torch, builds the model and data, one step
process_ratio       the whole process (start to exit) of those two runs                     <= 1.1
preflight_share     preflight's seconds on the example task (``train.py`` defaults) / the   <= 1.0
                    larger of 1 s and 2 % of its own ETA
save_ratio          our save (atomic protocol, xxh3 checksums, fsync, manifest, pointers,   <= 1.10
                    pruning) / one ``torch.save`` + fsync of the same state to the same
                    disk (``save_vs_raw_ratio``: against torch.save without fsync)
load_ratio          our load (every checksum verified, weights_only, applied) /             <= 1.15
                    torch.load + load_state_dict of the same state
async_block_ratio   time ``save`` blocks training, ``checkpoint.async_save=true`` / false    <= 0.25
log_overhead        1 - steps/s with ``tracker=[--trackers]`` / with ``tracker=none``:      <= 0.01
                    in one process, the loop's step and log step (every 10 steps) in
                    alternating blocks with and without ``accelerator.log``
step_ratio          one optimizer step, in one process: the bare step / the loop's own      >= 0.98
                    (the task's ``training_step`` through ``Step``: accelerate, the NaN guard, the
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

import bench_project

GOALS = {  # figure: (comparison, goal, the baseline it is measured against)
    "loop_ratio": (">=", 0.98, "a bare hand-written loop, steps/s"),
    "ddp_loop_ratio": (">=", 0.97, "a bare 2-process DDP loop, steps/s"),
    "first_step_ratio": ("<=", 1.1, "a bare script's time to its first step"),
    "process_ratio": ("<=", 1.1, "a bare script's whole process"),
    "preflight_share": ("<=", 1.0, "max(1 s, 2 % of the example's ETA)"),
    "save_ratio": ("<=", 1.10, "torch.save + fsync"),
    "load_ratio": ("<=", 1.15, "torch.load + load_state_dict"),
    "async_block_ratio": ("<=", 0.25, "our synchronous save"),
    "log_overhead": ("<=", 0.01, "tracker=none, same process, alternating"),
    "step_ratio": (">=", 0.98, "the bare step, same process, alternating"),
}
PARTS = ("loop", "ddp", "startup", "checkpoint", "log", "step")
CHILDREN = Path(__file__).resolve().with_name("bench_children.py")  # the timed processes
from bench_checkpoint import bench_checkpoint  # noqa: E402 (the checkpoint figures, in-process)
from bench_ckpt_memory import bench_ckpt_memory  # noqa: E402 (full vs sharded, 2 FSDP ranks)
from bench_step import bench_step  # noqa: E402 (the step alone: ours vs bare, in-process)
from bench_turns import run_in_turns  # noqa: E402 (two processes in lockstep)

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


# --- running the timed processes (bench_children.py) -----------------------------------------


def _run_child(kind: str, spec: dict, work: Path) -> dict:
    """Run one training process alone; return its time to the first optimizer
    step and the whole process's wall time."""
    out = work / f"{kind}-{time.monotonic_ns()}.json"
    spec_path = out.with_suffix(".spec.json")
    spec_path.write_text(json.dumps({**spec, "out": str(out)}))
    started = time.time()
    proc = subprocess.run(
        [sys.executable, str(CHILDREN), kind, str(spec_path)],
        cwd=bench_project.root(),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    process_s = time.time() - started
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"bench: the {kind} process failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(out.read_text())
    if len(result["times"]) != spec["steps"]:
        raise SystemExit(f"bench: {kind} took {len(result['times'])} optimizer steps")
    return {"first_step_s": result["first_step_at"][0] - started, "process_s": process_s}


def _loop_overrides(steps: int) -> list[str]:
    return [
        f"trainer.max_steps={steps}",
        f"trainer.eval_every_n_steps={steps}",  # evaluate once, after the timed steps
        "trainer.log_every_n_steps=10",
        "preflight=off",  # its checks run real steps before the loop: timed on their own
    ]


def _in_turns(args, overrides: list[str], work: Path, *, ddp: bool) -> dict:
    """``args.repeats`` rounds in which ours (train.py) and the bare loop run at
    once and take turns every 10 optimizer steps (bench_turns.py); per round,
    ours / bare steps/s. The bare loop pins the CPU threads as train.py does
    (``seeding.pin_cpu_threads``, for same-seed bits); in one process a third
    side, the bare loop unpinned, measures what the pin costs. Returns the
    medians over the rounds."""
    every = min(10, max(1, args.steps // 4))  # 10: one of train.py's log steps per block
    blocks = args.steps // every
    steps, untimed = blocks * every, -(-max(2, args.steps // 10) // every)
    run = [*overrides, *(["parallel=ddp"] if ddp else []), *_loop_overrides(steps)]
    config = compose(run)
    launcher = [sys.executable]
    if ddp:
        torchrun = Path(sys.executable).with_name("torchrun")
        launcher = [str(torchrun), "--standalone", "--nproc_per_node", "2"]
    # Under torchrun every process has one thread (OMP_NUM_THREADS=1): nothing to pin.
    sides = ["ours", "bare"] + ([] if ddp else ["bare_unpinned"])
    rounds: dict[str, list[float]] = {name: [] for name in ["ratio", "pin_cost", *sides]}
    for round_ in range(args.repeats):
        folder = work / f"turns-{round_}"
        folder.mkdir()
        commands = {}
        for side in sides if round_ % 2 == 0 else reversed(sides):
            turns = {"folder": str(folder), "side": side, "every": every}
            spec: dict = {"steps": steps, "out": str(folder / f"{side}.json"), "turns": turns}
            spec["cpu_steps"] = (untimed * every, steps)  # the timed blocks' CPU (DDP: reported)
            if side.startswith("bare"):
                spec |= {"config": config, "ddp": ddp, "pin_threads": side == "bare"}
            else:
                spec["overrides"] = [*run, f"hydra.run.dir={folder / 'run'}"]
            (folder / f"{side}.spec.json").write_text(json.dumps(spec))
            kind = "train" if side == "ours" else "bare"
            commands[side] = [*launcher, str(CHILDREN), kind, str(folder / f"{side}.spec.json")]
        seconds = run_in_turns(
            commands,
            folder,
            ranks=2 if ddp else 1,
            every=every,
            blocks=blocks,
            untimed=untimed,
            cwd=bench_project.root(),
        )
        for side in sides:
            rank0 = folder / (f"{side}.json.rank0" if ddp else f"{side}.json")
            taken = len(json.loads(rank0.read_text())["times"])
            if taken != steps:
                raise SystemExit(f"bench: {side} took {taken} optimizer steps, not {steps}")
            rounds[side].append(every * len(seconds[side]) / sum(seconds[side]))
            # One thread per process under torchrun; in one process the intra-op threads
            # spin at their barriers, and their CPU time measures the spinning.
            for name, ms in _cpu_per_step(folder, side, ranks=2).items() if ddp else ():
                rounds.setdefault(f"{side}_{name}", []).append(ms)
        rounds["ratio"].append(rounds["ours"][-1] / rounds["bare"][-1])
        line = f"ours {rounds['ours'][-1]:7.2f}, bare {rounds['bare'][-1]:7.2f}"
        if not ddp:
            rounds["pin_cost"].append(1 - rounds["bare"][-1] / rounds["bare_unpinned"][-1])
            line += f", bare unpinned {rounds['bare_unpinned'][-1]:7.2f}"
        print(
            f"  round {round_ + 1}/{args.repeats}: {line} steps/s; ratio {rounds['ratio'][-1]:.3f}"
            f" ({len(seconds['ours'])} timed blocks of {every} steps each)",
            flush=True,
        )
        shutil.rmtree(folder, ignore_errors=True)
    return {name: statistics.median(values) for name, values in rounds.items() if values}


def _cpu_per_step(folder: Path, side: str, *, ranks: int) -> dict[str, float]:
    """A side's CPU milliseconds per optimizer step and rank (bench_children's step clock):
    ``cpu_main`` its loop's thread, ``cpu_other`` its other threads. Where a loop's
    steps/s goes when both cores are busy (2 ranks on 2 cores): a millisecond of CPU
    on any thread of either rank is one the other rank's step waits for."""
    main = other = 0.0
    for rank in range(ranks):
        name = f"{side}.json" + (f".rank{rank}" if ranks > 1 else "")
        result = json.loads((folder / name).read_text())
        cpu = result.get("cpu")
        if not cpu:
            return {}
        per = 1000 / max(cpu["steps"], 1) / ranks
        main += cpu["main_s"] * per
        other += (cpu["process_s"] - cpu["main_s"]) * per
    return {"cpu_main": main, "cpu_other": other}


def compile_sources() -> None:
    """Bytecode for the engine's and the project's modules before anything is timed, as
    ``pip install`` of a release writes it for the installed engine. Without it an
    editable install run with ``PYTHONDONTWRITEBYTECODE=1`` (this template's CI machine)
    compiles all ~100 engine modules at every start: measured 194 -> 31 ms of train.py's
    imports on 2 cores, a cost of the checkout, not of the engine, that only our side pays."""
    import compileall
    import importlib.util

    engine = importlib.util.find_spec("training_engine")
    folders = [*(engine.submodule_search_locations or []), bench_project.root() / "src"]
    for folder in folders:
        compileall.compile_dir(str(folder), quiet=2)  # writes __pycache__ whatever the env says
    print("bytecode compiled for: " + ", ".join(str(f) for f in folders))


# --- the parts --------------------------------------------------------------------------------


def compose(overrides: list[str]) -> dict:
    """The resolved config ``python train.py OVERRIDES`` would run, as plain data."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    config = bench_project.module("engine.config")
    root = bench_project.root()
    config.register_resolvers(root)
    with initialize_config_dir(config_dir=str(root / "configs"), version_base="1.3"):
        cfg = hydra_compose("train", overrides=overrides)
    return OmegaConf.to_container(config.resolve_config(cfg), resolve=True)


def bench_loop(args, overrides: list[str], work: Path, results: dict, *, ddp: bool) -> None:
    """steps/s of ours (train.py with its defaults) against the bare loop, in
    turns (``ddp``: 2 processes each, under torchrun)."""
    medians = _in_turns(args, overrides, work, ddp=ddp)
    prefix = "ddp_" if ddp else ""
    results[f"{prefix}loop_ratio"] = medians["ratio"]
    results[f"{prefix}ours_steps_per_sec"] = medians["ours"]
    results[f"{prefix}bare_steps_per_sec"] = medians["bare"]
    if "ours_cpu_main" in medians and "bare_cpu_main" in medians:
        cpu = {
            f"{side}_{thread}": medians[f"{side}_cpu_{thread}"]
            for side in ("ours", "bare")
            for thread in ("main", "other")
        }
        results[f"{prefix}cpu_ms_per_step"] = cpu
        print(
            f"  CPU per step and rank (median): ours {cpu['ours_main']:.2f} ms in the loop's "
            f"thread + {cpu['ours_other']:.2f} ms in others, bare {cpu['bare_main']:.2f} + "
            f"{cpu['bare_other']:.2f} ms; the loop's thread, ours / bare: "
            f"{cpu['ours_main'] / cpu['bare_main']:.3f}"
        )
    if "pin_cost" in medians:  # 1 - steps/s of the bare loop pinned / unpinned
        results["thread_pin_cost"] = medians["pin_cost"]
        print(f"  the thread pin costs the bare loop {medians['pin_cost']:.1%} of its steps/s")


def bench_first_step(args, overrides: list[str], work: Path, results: dict) -> None:
    """Time to the first step and the whole process: ours and bare one after
    the other (alone: a start-up is what is timed), alternating the order."""
    run = [*overrides, *_loop_overrides(args.steps)]
    config = compose(run)
    runs: dict[str, list[dict]] = {"ours": [], "bare": []}
    for round_ in range(args.repeats):
        for side in ("ours", "bare") if round_ % 2 == 0 else ("bare", "ours"):
            spec: dict = {"steps": args.steps}
            if side == "bare":
                result = _run_child("bare", {**spec, "config": config}, work)
            else:
                run_dir = work / f"run-{round_}"
                spec["overrides"] = [*run, f"hydra.run.dir={run_dir}"]
                result = _run_child("train", spec, work)
                shutil.rmtree(run_dir, ignore_errors=True)
            runs[side].append(result)
            print(
                f"  round {round_ + 1}/{args.repeats} {side:<5} first step after "
                f"{result['first_step_s']:.2f} s, process {result['process_s']:.2f} s",
                flush=True,
            )
    for key, figure in [("first_step_s", "first_step_ratio"), ("process_s", "process_ratio")]:
        ours = statistics.median(r[key] for r in runs["ours"])
        bare = statistics.median(r[key] for r in runs["bare"])
        results[figure], results[f"ours_{key}"], results[f"bare_{key}"] = ours / bare, ours, bare


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
        proc = subprocess.run(cmd, cwd=bench_project.root(), capture_output=True, text=True)
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
    bench_project.add_option(parser)
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
    parser.add_argument("--dir", type=Path, default=None, help="scratch (default: the project)")
    args = parser.parse_args(argv)
    bench_project.use_option(parser, args)
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
        from training_engine.testing import config_options

        options = config_options(bench_project.root())
        args.trackers = [t for t in wanted if ("tracker", t) in options]
    else:
        args.trackers = [t.strip() for t in args.trackers.split(",") if t.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    where = "quick" if args.quick else ("gpu" if torch.cuda.is_available() else "cpu")
    overrides = args.overrides if args.overrides is not None else [*GPT, *SIZES[where]]
    work = Path(tempfile.mkdtemp(prefix="bench_", dir=args.dir or bench_project.root()))
    results: dict = {}
    print(f"project: {bench_project.root()} (package {bench_project.package_name()})")
    print(f"workload: {' '.join(overrides) or '(defaults)'}; {args.repeats} round(s)")
    print(f"load average before: {_load()} ({os.cpu_count()} CPUs)")
    compile_sources()
    try:
        if "loop" in args.only:
            print(f"training runs of {args.steps} steps, ours and bare in turns:")
            (work / "loop").mkdir()
            bench_loop(args, overrides, work / "loop", results, ddp=False)
        if "ddp" in args.only:
            print(f"2-process DDP runs of {args.steps} steps, ours and bare in turns:")
            (work / "ddp").mkdir()
            bench_loop(args, overrides, work / "ddp", results, ddp=True)
        if "startup" in args.only:
            print(f"training runs of {args.steps} steps, one at a time (start-up timed):")
            (work / "first_step").mkdir()
            bench_first_step(args, overrides, work / "first_step", results)
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
