"""The processes ``bench.py`` times, each run as ``python bench/bench_children.py
KIND SPEC.json`` (under ``torchrun`` for the DDP kinds): ours (the project's
``train.py``), the bare loops it is compared with (one process, and DDP), and the
start-up costs. The project is ``bench_project``'s (``BENCH_PROJECT``, set by bench.py).

Every training process gets the same step clock: a global optimizer-step hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``), so neither side
measures itself differently. Under DDP each rank writes its own file.
"""

import json
import os
import sys
import time
from pathlib import Path

STARTED = time.time()  # this process's first line of Python (after the interpreter started)

import bench_project  # noqa: E402 (after the clock: what a start costs is timed from above)


def install_step_clock(
    out_path: str, turns: dict | None = None, cpu_steps: tuple[int, int] | None = None
) -> None:
    """Record when every optimizer step ends (wall clock for the first, a
    monotonic clock for all) and write them to ``out_path`` (``.rankN`` under
    a launcher) at exit. With ``turns`` (bench_turns.py: folder, side, every),
    take turns with the other side every ``every`` steps. With ``cpu_steps`` (from,
    to), also the CPU time between those steps' ends: the main thread's
    (``time.thread_time``: the loop) and the whole process's (the rest: the
    collectives' threads, a watchdog, a tracker's writer); a side waiting for its
    turn uses none. Read at those two steps only: no clock read in the steps between."""
    import atexit

    import torch
    from bench_turns import Turn
    from torch.optim.optimizer import register_optimizer_step_post_hook

    first: list[float] = []
    times: list[float] = []
    cpu: list[float] = []  # main thread, process: at cpu_steps' two ends
    turn = Turn(**turns) if turns else None

    def hook(optimizer, args, kwargs) -> None:
        # accelerate's optimizer wrapper steps the real one: count the real one only.
        if type(optimizer).__module__.startswith("torch.optim"):
            times.append(time.perf_counter())
            if cpu_steps is not None and len(times) in cpu_steps:
                cpu.extend([time.thread_time(), time.process_time()])
            if not first:
                first.append(time.time())
            if turn is not None:
                turn.after_step()

    register_optimizer_step_post_hook(hook)
    if "RANK" in os.environ:
        out_path = f"{out_path}.rank{os.environ['RANK']}"

    def write() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        Path(out_path).write_text(
            json.dumps(
                {
                    "first_step_at": first[:1],
                    "times": times,
                    "started": STARTED,
                    "cpu": {
                        "main_s": cpu[2] - cpu[0],
                        "process_s": cpu[3] - cpu[1],
                        "steps": cpu_steps[1] - cpu_steps[0],
                    }
                    if cpu_steps is not None and len(cpu) == 4
                    else None,
                }
            )
        )

    atexit.register(write)


def child_train(spec: dict) -> None:
    """``python train.py OVERRIDES``, with the step clock installed."""
    import runpy

    install_step_clock(spec["out"], spec.get("turns"), spec.get("cpu_steps"))
    root = bench_project.root()
    sys.argv = [str(root / "train.py"), *spec["overrides"]]
    sys.path.insert(0, str(root))
    runpy.run_path(str(root / "train.py"), run_name="__main__")


def _build(node: dict):
    """A tiny ``hydra.utils.instantiate`` for the bare side (no Hydra import)."""
    import functools
    import importlib

    kwargs = {k: v for k, v in node.items() if not k.startswith("_")}
    module, _, name = node["_target_"].rpartition(".")
    target = getattr(importlib.import_module(module), name)
    return functools.partial(target, **kwargs) if node.get("_partial_") else target(**kwargs)


def bare_model_node(node: dict) -> dict:
    """The model's node less ``peft``: the engine's key (training_engine/adapters.py),
    not an argument of the model."""
    return {k: v for k, v in node.items() if k != "peft"}


def child_bare(spec: dict) -> None:
    """The floor: the same model, data, optimizer, schedule, clipping and
    precision in a hand-written loop, with nothing else. Under ``torchrun``
    (``spec["ddp"]``): the same in DDP (gloo on CPU, NCCL on GPU), each rank
    its own batches of the per-process batch size."""
    install_step_clock(spec["out"], spec.get("turns"), spec.get("cpu_steps"))
    import torch

    if spec.get("pin_threads", True):
        # What seeding.pin_cpu_threads does in train.py (fixed count, MKL's dynamic
        # threading off: same seed, same bits), without importing accelerate here.
        torch.set_num_threads(torch.get_num_threads())
    cfg, steps = spec["config"], spec["steps"]
    rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if spec.get("ddp"):
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(cfg["seed"] + int(os.environ.get("RANK", 0)))
    loaders = _build(cfg["data"])
    model = _build(bare_model_node(cfg["model"])).to(device)
    task = _build(cfg["task"])
    # the task's groups, as train.py builds the optimizer (no decay on norms and biases)
    optimizer = _build(cfg["optimizer"])(task.param_groups(model))
    scheduler = _build(cfg["scheduler"])(optimizer, total_steps=steps)
    if spec.get("ddp"):
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rank] if cuda else None
        )
    if cfg["trainer"].get("compile"):
        model = torch.compile(model)
    bf16 = cfg["trainer"]["mixed_precision"] == "bf16"
    clip = cfg["trainer"]["grad_clip_norm"]
    bare_step = bare_stepper(clip=clip, bf16=bf16, device=device, task=task)
    done = 0
    while done < steps:
        for batch in loaders.train:
            bare_step(model, optimizer, batch)
            scheduler.step()
            done += 1
            if done == steps:
                break
    if spec.get("ddp"):
        torch.distributed.destroy_process_group()


def bare_stepper(*, clip: float | None, bf16: bool, device, task):
    """The bare loop's step, ``step(model, optimizer, batch) -> loss`` (bench_step.py
    times it in-process too), with the run's task's loss (the same as train.py's).
    The imports happen here, once, not in every step."""
    import torch

    def step(model, optimizer, batch):
        batch = [t.to(device, non_blocking=True) for t in batch]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, _ = task.loss(model=model, batch=batch)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def child_startup(spec: dict) -> None:
    """The fixed costs of ``python train.py`` (the defaults) one by one, in a
    fresh process: imports (torch, Hydra, accelerate, the rest train.py
    imports), composing the config, building the accelerator; written to
    ``spec["out"]``. Then ``train.py preflight.only=true`` in this process:
    its train.log says how long preflight took."""
    costs = {"interpreter start (to the first line)": STARTED - spec["launched_at"]}

    def mark(name: str, since: float) -> float:
        now = time.time()
        costs[name] = now - since
        return now

    t = time.time()
    import torch

    t = mark("import torch", t)
    import hydra  # noqa: F401
    import omegaconf  # noqa: F401

    t = mark("import hydra, omegaconf", t)
    import accelerate  # noqa: F401

    t = mark("import accelerate", t)
    import runpy

    root = bench_project.root()
    sys.path.insert(0, str(root))
    runpy.run_path(str(root / "train.py"), run_name="bench_import")  # its imports only
    t = mark("import the rest of train.py's modules", t)
    from hydra import compose, initialize_config_dir

    config = bench_project.module("engine.config")
    config.register_resolvers(root)
    with initialize_config_dir(config_dir=str(root / "configs"), version_base="1.3"):
        cfg = config.resolve_config(compose("train", overrides=spec["overrides"]))
    t = mark("compose and resolve the config (Hydra)", t)
    from accelerate import Accelerator

    Accelerator(cpu=not torch.cuda.is_available())
    mark("build the Accelerator", t)
    del cfg
    Path(spec["out"]).write_text(json.dumps(costs))
    sys.argv = [str(root / "train.py"), *spec["overrides"], "preflight.only=true"]
    sys.argv.append(f"hydra.run.dir={spec['run_dir']}")
    runpy.run_path(str(root / "train.py"), run_name="__main__")


if __name__ == "__main__":
    kinds = {"train": child_train, "bare": child_bare, "startup": child_startup}
    kinds[sys.argv[1]](json.loads(Path(sys.argv[2]).read_text()))
