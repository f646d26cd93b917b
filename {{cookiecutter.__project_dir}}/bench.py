"""What this project's infrastructure costs, measured against bare PyTorch in one run.

    python bench.py                          # every figure; a few minutes; prints a table
    python bench.py --quick                  # tiny sizes, 1 round (CI: printed, not judged)
    python bench.py --json bench.json        # also write the figures, settings and machine
    python bench.py --only checkpoint        # some parts: loop, startup, checkpoint, log
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
first_step_ratio    process start -> first optimizer step done: ``python train.py`` / a     <= 1.5
                    bare script that imports torch, builds the model and data, one step
save_ratio          our save (atomic protocol, sha256, fsync, manifest, pointers, pruning)   <= 1.10
                    / one ``torch.save`` of the same state to the same disk (no fsync;
                    ``save_vs_fsync_ratio`` compares with torch.save + fsync)
load_ratio          our load (every sha256 verified, weights_only, applied) / torch.load +  <= 1.10
                    load_state_dict of the same state
async_block_ratio   time ``save`` blocks training with ``checkpoint.async=true`` / without  <= 0.25
log_overhead        1 - steps/s with ``tracker=[--trackers]`` / with ``tracker=none``        <= 0.01
==================  =====================================================================  ======

The default workload is the GPT example (``model=gpt data=tokens``): small on a
CPU, its configured size with bf16 on a GPU. With ``trainer.compile=true`` in
``--overrides`` both sides compile. Timings on a busy machine are noisy: compare
ratios from one run, not across machines.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
GOALS = {  # figure: (comparison, goal)
    "loop_ratio": (">=", 0.98),
    "first_step_ratio": ("<=", 1.5),
    "save_ratio": ("<=", 1.10),
    "load_ratio": ("<=", 1.10),
    "async_block_ratio": ("<=", 0.25),
    "log_overhead": ("<=", 0.01),
}
PARTS = ("loop", "startup", "checkpoint", "log")
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


# --- the two kinds of training process ------------------------------------------------------


def _install_step_clock(out_path: str) -> None:
    """Record when every optimizer step ends (wall clock for the first, a
    monotonic clock for all) and write them to ``out_path`` at exit."""
    import atexit

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    first: list[float] = []
    times: list[float] = []

    def hook(optimizer, args, kwargs) -> None:
        # accelerate's optimizer wrapper steps the real one: count the real one only.
        if type(optimizer).__module__.startswith("torch.optim"):
            times.append(time.perf_counter())
            if not first:
                first.append(time.time())

    register_optimizer_step_post_hook(hook)

    def write() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        Path(out_path).write_text(json.dumps({"first_step_at": first[:1], "times": times}))

    atexit.register(write)


def _child_train(spec: dict) -> None:
    """``python train.py OVERRIDES``, with the step clock installed."""
    import runpy

    _install_step_clock(spec["out"])
    sys.argv = [str(ROOT / "train.py"), *spec["overrides"]]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


def _build(node: dict):
    """A tiny ``hydra.utils.instantiate`` for the bare side (no Hydra import)."""
    import functools
    import importlib

    kwargs = {k: v for k, v in node.items() if not k.startswith("_")}
    module, _, name = node["_target_"].rpartition(".")
    target = getattr(importlib.import_module(module), name)
    return functools.partial(target, **kwargs) if node.get("_partial_") else target(**kwargs)


def _child_bare(spec: dict) -> None:
    """The floor: the same model, data, optimizer, schedule, clipping and
    precision in a hand-written loop, with nothing else."""
    _install_step_clock(spec["out"])
    import torch

    from {{ cookiecutter.package_name }} import task  # the same loss as train.py's

    cfg, steps = spec["config"], spec["steps"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg["seed"])
    loaders = _build(cfg["data"])
    model = _build(cfg["model"]).to(device)
    optimizer = _build(cfg["optimizer"])(model.parameters())
    scheduler = _build(cfg["scheduler"])(optimizer, total_steps=steps)
    if cfg["trainer"].get("compile"):
        model = torch.compile(model)
    bf16 = cfg["trainer"]["mixed_precision"] == "bf16"
    clip = cfg["trainer"]["grad_clip_norm"]
    done = 0
    while done < steps:
        for batch in loaders.train:
            batch = [t.to(device, non_blocking=True) for t in batch]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = task.loss(model=model, batch=batch)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            done += 1
            if done == steps:
                break


def _run_child(kind: str, spec: dict, work: Path) -> dict:
    """Run one training process; return its step times and start-up time."""
    out = work / f"{kind}-{time.monotonic_ns()}.json"
    spec = {**spec, "out": str(out)}
    spec_path = out.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    started = time.time()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench.py"), "--child", kind, str(spec_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
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


def bench_loops(args, overrides: list[str], work: Path, results: dict) -> None:
    """Ours and bare in alternation; train.py also with tracker=none and with
    the --trackers list when the log part is on."""
    steps, warmup = args.steps, max(2, args.steps // 10)
    if any(o.startswith("trainer.compile=true") for o in overrides):
        warmup = max(warmup, args.steps // 3)  # compiling takes the first steps
    common = [
        f"trainer.max_steps={steps}",
        f"trainer.eval_every_n_steps={steps}",  # evaluate once, after the timed steps
        "trainer.log_every_n_steps=10",
        "preflight=off",  # its checks run real steps before the loop: timed on their own
    ]
    config = compose([*overrides, *common])
    tracked = f"ours, tracker=[{','.join(args.trackers)}]"
    variants = {}
    if {"loop", "startup"} & set(args.only) or (
        "log" in args.only and sorted(config["tracker"]) == sorted(args.trackers)
    ):
        variants["ours"] = []  # the defaults; when they are --trackers, that run serves both
    if "log" in args.only:
        variants["ours, tracker=none"] = ["tracker=none"]
        if "ours" not in variants or sorted(config["tracker"]) != sorted(args.trackers):
            variants[tracked] = [f"tracker=[{','.join(args.trackers)}]"]
    runs: dict[str, list[dict]] = {name: [] for name in [*variants, "bare"]}
    for round_ in range(args.repeats):
        order = [*variants, "bare"]
        if round_ % 2:
            order.reverse()
        for name in order:
            spec = {"steps": steps, "warmup": warmup}
            if name == "bare":
                result = _run_child("bare", {**spec, "config": config}, work)
            else:
                run_dir = work / f"run-{len(os.listdir(work))}"
                spec["overrides"] = [
                    *overrides,
                    *common,
                    *variants[name],
                    f"hydra.run.dir={run_dir}",
                ]
                result = _run_child("train", spec, work)
                shutil.rmtree(run_dir, ignore_errors=True)
            runs[name].append(result)
            print(
                f"  round {round_ + 1}/{args.repeats} {name:<32} "
                f"{result['steps_per_sec']:8.2f} steps/s, first step after "
                f"{result['first_step_s']:.2f} s",
                flush=True,
            )

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
    if "log" in args.only:
        none = med("ours, tracker=none", "steps_per_sec")
        with_trackers = med(tracked if tracked in runs else "ours", "steps_per_sec")
        results["log_overhead"] = 1 - with_trackers / none
        results["tracker_none_steps_per_sec"] = none
        results["trackers_steps_per_sec"] = with_trackers


def bench_checkpoint(args, overrides: list[str], work: Path, results: dict) -> None:
    """Our save/load against torch.save/torch.load of the same state, and the
    time an async save blocks against a sync one, in this process."""
    import torch
    from accelerate import Accelerator
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from {{ cookiecutter.package_name }} import task
    from {{ cookiecutter.package_name }}.checkpoint import CheckpointManager
    from {{ cookiecutter.package_name }}.state import TrainState, rng_state

    cfg = OmegaConf.create(compose(overrides))
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = instantiate(cfg.model)
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=100)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    batch = [t.to(accelerator.device) for t in next(iter(instantiate(cfg.data).train))]
    task.loss(model=model, batch=batch).backward()
    optimizer.step()  # the optimizer state exists
    scheduler.step()

    state = TrainState(model, optimizer, scheduler, train_loader=[], val_loader=[])

    def manager(asynchronous: bool) -> CheckpointManager:
        settings = {"enabled": True, "keep_last": 2, "save_on_signal": False}
        return CheckpointManager(
            checkpoint={**settings, "async": asynchronous},
            config=OmegaConf.to_container(cfg, resolve=True),
            run_dir=work / ("async" if asynchronous else "sync"),
            accelerator=accelerator,
            state=state,
        )

    sync, background = manager(False), manager(True)
    raw_path = work / "raw.pt"
    unwrapped = accelerator.unwrap_model(model)

    def raw_state() -> dict:
        return {
            "model": unwrapped.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
        }

    def raw_save_fsync() -> None:
        with open(raw_path, "wb") as f:
            torch.save(raw_state(), f)
            f.flush()
            os.fsync(f.fileno())

    def raw_load() -> None:
        state = torch.load(raw_path, map_location="cpu", weights_only=True)
        unwrapped.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])

    step = iter(range(1, 10**6))
    last: list[Path] = []

    def our_save() -> None:
        last.append(sync.save(next(step), 0, 0, ["bench"]))

    def async_save() -> None:
        background.save(next(step), 0, 0, ["bench"])  # returns once staged

    steps = {
        "raw save": lambda: torch.save(raw_state(), raw_path),
        "our save": our_save,
        "raw save+fsync": raw_save_fsync,
        "raw load": raw_load,
        "our load": lambda: sync.load(last[-1]),
        "async save (blocking)": async_save,
    }
    groups = [["raw save", "our save", "async save (blocking)"], ["raw save+fsync"]]
    groups.append(["raw load", "our load"])  # each loads what the round saved
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(args.repeats + 1):  # round 0 warms up and is dropped
        for group in groups:
            for name in group if round_ % 2 else reversed(group):
                background.wait()  # the async save in flight is done before anything is timed
                start = time.perf_counter()
                steps[name]()
                if round_:
                    times[name].append(time.perf_counter() - start)
    background.wait()
    med = {name: statistics.median(values) for name, values in times.items()}
    size = sum(p.stat().st_size for p in last[-1].iterdir()) / 2**20
    params = sum(p.numel() for p in unwrapped.parameters())
    print(f"  checkpoint of {params:,} parameters + optimizer state: {size:.1f} MB")
    for name, value in med.items():
        print(f"  {name:<24} {value * 1000:9.1f} ms")
    results["save_ratio"] = med["our save"] / med["raw save"]
    results["save_vs_fsync_ratio"] = med["our save"] / med["raw save+fsync"]
    results["load_ratio"] = med["our load"] / med["raw load"]
    results["async_block_ratio"] = med["async save (blocking)"] / med["our save"]
    results["checkpoint_mb"] = size
    results.update({f"{k.replace(' ', '_')}_ms": v * 1000 for k, v in med.items()})


# --- checkpoint memory: full vs sharded -------------------------------------------------------


def _peak_rss_since_reset() -> int:
    """This process's resident-set high-water mark (VmHWM, bytes) since the
    last reset (``/proc/self/clear_refs``: Linux only)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> int:
    """Return freed memory to the OS, reset the high-water mark to the current
    RSS and return that (so memory a previous phase freed is not counted)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _peak_rss_since_reset()


def _child_ckpt_memory(spec: dict) -> None:
    """One FSDP rank: saves and loads the same state in both layouts with the
    checkpoint package's own functions, and records its peak RSS above the
    resident state during each (RANK etc. come from the parent's environment)."""
    import torch
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    from {{ cookiecutter.package_name }}.accel import build_accelerator
    from {{ cookiecutter.package_name }}.checkpoint import format as fmt
    from {{ cookiecutter.package_name }}.checkpoint import full_state, sharded

    cfg = OmegaConf.create(spec["config"])
    acc = build_accelerator(cfg, Path(spec["dir"]))
    width, layers = spec["width"], spec["layers"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    model(torch.randn(2, width)).sum().backward()  # AdamW's state exists after a step
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out: dict = {"rank": acc.process_index}
    for layout in ("full", "sharded"):
        folder = Path(spec["dir"]) / layout
        if acc.is_main_process:
            folder.mkdir()
        acc.wait_for_everyone()
        base = _reset_peak_rss()
        tensors, shards, extra = full_state.take(layout, acc, model, optimizer)
        if layout == "full" and acc.is_main_process:
            fmt.write_main_files(folder, 0, tensors, {})
        elif layout == "sharded":
            sharded.write(folder, *shards, 0)
            if acc.is_main_process:
                (folder / sharded.OPTIMIZER_GROUPS).write_bytes(extra[sharded.OPTIMIZER_GROUPS])
        del tensors, shards
        out[f"{layout}_save_peak"] = _peak_rss_since_reset() - base
        acc.wait_for_everyone()
        base = _reset_peak_rss()
        if layout == "full":
            loaded = {
                "model.safetensors": load_file(folder / "model.safetensors"),
                "optimizer.pt": fmt.load_tensors_safely(folder / "optimizer.pt", "optimizer.pt"),
            }
        else:
            groups = json.loads((folder / sharded.OPTIMIZER_GROUPS).read_text())
            loaded = {sharded.OPTIMIZER_GROUPS: groups}
        full_state.restore(layout, folder, acc, model, optimizer, loaded)
        del loaded
        out[f"{layout}_load_peak"] = _peak_rss_since_reset() - base
        acc.wait_for_everyone()
    out["shard_bytes"] = sum(
        p.stat().st_size
        for p in (Path(spec["dir"]) / "sharded").rglob(f"shard-{acc.process_index + 1:05d}-*")
    )
    out["state_bytes"] = sum(p.stat().st_size for p in (Path(spec["dir"]) / "full").iterdir())
    Path(spec["out"].format(rank=acc.process_index)).write_text(json.dumps(out))
    acc.wait_for_everyone()
    acc.end_training()


def bench_ckpt_memory(args, work: Path, results: dict) -> None:
    """Peak resident memory per rank above the live state while saving and
    loading the model + AdamW state under 2-process FSDP (gloo on CPU),
    ``checkpoint.format`` full (gathered on the main process) vs sharded (each
    rank its shards). An MLP of 8 x 2048^2 (quick: 4 x 512^2): ~400 MB of state."""
    import socket

    width, layers = (512, 4) if args.quick else (2048, 8)
    config = compose(["parallel=fsdp", "parallel.auto_wrap_min_params=1000"])
    folder = work / "ckpt_memory"
    folder.mkdir()
    spec = {"config": config, "dir": str(folder), "width": width, "layers": layers}
    spec["out"] = str(folder / "rank{rank}.json")
    (folder / "spec.json").write_text(json.dumps(spec))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        env |= {"LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # freed tensors leave the RSS at once
        cmd = [
            sys.executable,
            str(ROOT / "bench.py"),
            "--child",
            "memory",
            str(folder / "spec.json"),
        ]
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    for proc in procs:
        output, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"bench: a ckpt_memory rank failed:\n{output[-3000:]}")
    mib = 2**20
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    state = ranks[0]["state_bytes"]
    print(
        f"  checkpoint memory, FSDP on 2 processes, model + AdamW state {state / mib:.0f} MiB "
        "(peak RSS above the live state, MiB):"
    )
    head = ("rank", "shard MiB", "full save", "sharded save", "full load", "sharded load")
    print("  " + " ".join(f"{h:>{w}}" for h, w in zip(head, (4, 10, 10, 13, 10, 13), strict=True)))
    for r in ranks:
        print(
            f"  {r['rank']:>4} {r['shard_bytes'] / mib:>10.0f} {r['full_save_peak'] / mib:>10.0f} "
            f"{r['sharded_save_peak'] / mib:>13.0f} {r['full_load_peak'] / mib:>10.0f} "
            f"{r['sharded_load_peak'] / mib:>13.0f}"
        )
        for key in (
            "full_save_peak",
            "sharded_save_peak",
            "full_load_peak",
            "sharded_load_peak",
            "shard_bytes",
        ):
            results[f"ckpt_memory_rank{r['rank']}_{key}_mib"] = round(r[key] / mib, 1)
    results["ckpt_memory_state_mib"] = round(state / mib, 1)


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


def report(results: dict) -> None:
    print(f"\n{'figure':<20} {'value':>8}   goal")
    for name, (op, goal) in GOALS.items():
        if name not in results:
            continue
        value = results[name]
        met = value >= goal if op == ">=" else value <= goal
        print(f"{name:<20} {value:8.3f}   {op} {goal}  {'met' if met else 'NOT MET'}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round (for CI)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--repeats", type=int, help="rounds (default 5; quick: 1)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (200; quick: 20)")
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
    args.steps = args.steps or (20 if args.quick else 200)
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in args.only if p not in PARTS + EXTRA_PARTS]
    if bad:
        parser.error(f"--only {','.join(bad)}: choose from {', '.join(PARTS)}")
    if args.trackers is None:
        import importlib.util

        available = importlib.util.find_spec("tensorboard") is not None
        wanted = ["csv"] + (["tensorboard"] if available else [])
        args.trackers = [t for t in wanted if (ROOT / f"configs/tracker/{t}.yaml").exists()]
    else:
        args.trackers = [t.strip() for t in args.trackers.split(",") if t.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--child":
        spec = json.loads(Path(sys.argv[3]).read_text())
        children = {"train": _child_train, "bare": _child_bare, "memory": _child_ckpt_memory}
        children[sys.argv[2]](spec)
        return 0
    args = parse_args(argv)
    import torch

    where = "quick" if args.quick else ("gpu" if torch.cuda.is_available() else "cpu")
    overrides = args.overrides if args.overrides is not None else [*GPT, *SIZES[where]]
    work = Path(tempfile.mkdtemp(prefix="bench_", dir=args.dir or ROOT))
    results: dict = {}
    print(f"workload: {' '.join(overrides) or '(defaults)'}; {args.repeats} round(s)")
    try:
        if {"loop", "startup", "log"} & set(args.only):
            print(
                f"training runs of {args.steps} steps (first {max(2, args.steps // 10)} untimed):"
            )
            (work / "loops").mkdir()
            bench_loops(args, overrides, work / "loops", results)
        if "checkpoint" in args.only:
            print("checkpoints:")
            size = [] if args.quick or args.overrides is not None else CHECKPOINT_SIZE[where]
            (work / "checkpoint").mkdir()
            bench_checkpoint(args, [*overrides, *size], work / "checkpoint", results)
        if "ckpt_memory" in args.only:
            bench_ckpt_memory(args, work, results)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results)
    if args.json:
        payload = {
            "figures": {k: results[k] for k in GOALS if k in results},
            "details": {k: v for k, v in results.items() if k not in GOALS},
            "goals": {k: f"{op} {goal}" for k, (op, goal) in GOALS.items()},
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
