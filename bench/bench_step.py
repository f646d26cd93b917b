"""``bench.py``'s in-process step figure: the loop's own optimizer step (the task's
``training_step`` through the engine's ``Step``: accelerate's ``accumulate``/``backward``/
``clip_grad_norm_``, its optimizer wrapper, the NaN guard, and accelerate's
prepared data loader) against the bare step (``loss.backward()``, torch's
``clip_grad_norm_``, the optimizer itself, the plain loader) on the same model,
data and optimizer, in blocks that alternate within one process.

Why in one process: between processes, steps/s on a shared 2-core VM drifts by
up to 30 % over tens of seconds (bench/README.md), more than the 2 % this
figure judges; blocks of 10 steps (~0.1 s) that alternate see the same machine
(in blocks of 40 steps, a side that did strictly more came out 0.45 ms faster).

With the log part (``--only log``) two more sides alternate with them: the step
plus, every ``trainer.log_every_n_steps``, the metrics train.py builds at a log
step (the loss all-reduce and its host sync included), once without and once
with ``accelerator.log`` to the ``--trackers`` (``log_overhead``: what the
trackers cost, the rest of a log step being the same with ``tracker=none``)."""

import statistics
import time
from pathlib import Path

import bench_project


def bench_step(args, config: dict, work: Path, results: dict) -> None:
    import torch
    from bench_children import bare_stepper  # the bare loop's own step
    from omegaconf import OmegaConf

    build_accelerator = bench_project.module("engine.accel").build_accelerator
    instantiate = bench_project.module("engine.config").instantiate
    LossGuard = bench_project.module("engine.nonfinite").LossGuard
    StopSignals = bench_project.module("engine.preemption").StopSignals
    StepAgreement = bench_project.module("engine.agreement").StepAgreement
    Step = bench_project.module("engine.step").Step

    cfg = OmegaConf.create(config)  # the workload's resolved config (--trackers, or none)
    accelerator = build_accelerator(cfg, work)
    accelerator.init_trackers(cfg.project)
    loaders = instantiate(cfg.data, what="data")
    base_node = bench_project.module("engine.adapters").base_node  # model.peft: none here
    model = instantiate(base_node(cfg.model), what="model")
    optimizer = instantiate(cfg.optimizer, what="optimizer")(model.parameters())
    model, wrapped, prepared = accelerator.prepare(model, optimizer, loaders.train)
    guard = StepAgreement(  # the loop's: a NaN guard, no signals
        accelerator=accelerator,
        guard=LossGuard(cfg.trainer.on_nan, accelerator),
        signals=StopSignals(enabled=False),
        every_n_steps=cfg.trainer.log_every_n_steps,
    )
    task = instantiate(cfg.task, what="task")
    verbs = Step(
        accelerator=accelerator,
        agreement=guard,
        clip_norm=cfg.trainer.grad_clip_norm,
        models={"model": model},
        optimizer=wrapped,
    )
    clip, device = cfg.trainer.grad_clip_norm, accelerator.device
    loss_sum = torch.zeros((), device=device)

    def forever(loader):
        epoch = 0
        while True:
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            yield from loader
            epoch += 1

    plain_batches, our_batches = forever(loaders.train), forever(prepared)

    bf16 = accelerator.mixed_precision == "bf16"
    bare_step = bare_stepper(clip=clip, bf16=bf16, device=device, task=task)

    def bare() -> None:  # the bare loop's step (bench_children.py)
        nonlocal loss_sum
        batch = next(plain_batches)
        loss = bare_step(model, optimizer, batch)
        loss_sum += loss.detach()

    def ours():  # what train.py's loop does per step, but the bookkeeping; the grad norm
        nonlocal loss_sum
        loss, _ = task.training_step(step=verbs, batch=next(our_batches))
        verbs.update_done()
        loss_sum += loss.detach()
        return verbs.grad_norm

    log_every, logged = cfg.trainer.log_every_n_steps, [0]

    def logging(track: bool):  # ours, and a log step's metrics every log_every steps
        count = 0

        def step() -> None:
            nonlocal count
            norm = ours()
            count += 1
            if count % log_every == 0:
                metrics = {
                    "train/loss": accelerator.reduce(loss_sum, "mean").item() / log_every,
                    "train/lr": optimizer.param_groups[0]["lr"],
                    "train/grad_norm": float(norm if norm is not None else 0.0),
                    "perf/steps_per_sec": float(count),
                }
                loss_sum.zero_()
                if track:
                    accelerator.log(metrics, step=logged[0])
                    logged[0] += 1

        return step

    def block(step, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / n

    n = log_every  # every block of the log sides has one log step
    sides = {"bare": bare, "ours": ours}
    if "log" in args.only:
        sides |= {"ours, tracker=none": logging(False), "ours, trackers": logging(True)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    warmup = 1 if args.quick else 4  # rounds not counted
    for round_ in range(warmup + (2 if args.quick else 40 * args.repeats)):
        for name in sides if round_ % 2 else reversed(sides):
            seconds = block(sides[name], n)
            if round_ >= warmup:
                times[name].append(seconds)
    med = {name: statistics.median(values) for name, values in times.items()}
    rounds = len(times["bare"])
    for name, value in med.items():
        print(f"  {name + ' step':<28} {value * 1000:9.2f} ms (median of {rounds} blocks of {n})")
    results["step_ratio"] = med["bare"] / med["ours"]
    results["ours_step_ms"], results["bare_step_ms"] = med["ours"] * 1000, med["bare"] * 1000
    if "log" in args.only:
        results["log_overhead"] = 1 - med["ours, tracker=none"] / med["ours, trackers"]
        results["log_calls"] = logged[0]
        print(f"  {logged[0]} log calls to {', '.join(cfg.tracker)} (every {log_every} steps)")
    accelerator.end_training()  # the trackers' files are complete
    # accelerate's state is one per process: the checkpoint part builds its own.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
