"""``bench.py``'s in-process step figure: the loop's own optimizer step
(``state.optimizer_step``: accelerate's ``accumulate``/``backward``/
``clip_grad_norm_``, its optimizer wrapper, the NaN guard, and accelerate's
prepared data loader) against the bare step (``loss.backward()``, torch's
``clip_grad_norm_``, the optimizer itself, the plain loader) on the same model,
data and optimizer, in blocks that alternate within one process.

Why in one process: between processes, steps/s on a shared 2-core VM drifts by
up to 30 % over tens of seconds (README, "Performance"), more than the 2 % this
figure judges; blocks that alternate every ~0.5 s see the same machine."""

import statistics
import time
from pathlib import Path


def bench_step(args, config: dict, work: Path, results: dict) -> None:
    import torch
    from bench_children import bare_stepper  # the bare loop's own step
    from omegaconf import OmegaConf

    from {{ cookiecutter.package_name }}.accel import build_accelerator
    from {{ cookiecutter.package_name }}.config import instantiate
    from {{ cookiecutter.package_name }}.nonfinite import LossGuard
    from {{ cookiecutter.package_name }}.state import TrainState, optimizer_step

    cfg = OmegaConf.create(config)  # the resolved config of the workload (tracker=none)
    accelerator = build_accelerator(cfg, work)
    loaders = instantiate(cfg.data, what="data")
    model = instantiate(cfg.model, what="model")
    optimizer = instantiate(cfg.optimizer, what="optimizer")(model.parameters())
    model, wrapped, prepared = accelerator.prepare(model, optimizer, loaders.train)
    state = TrainState(model, wrapped, None, train_loader=prepared, val_loader=[])
    guard = LossGuard(cfg.trainer.on_nan, accelerator)
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

    bare_step = bare_stepper(clip=clip, bf16=accelerator.mixed_precision == "bf16", device=device)

    def bare() -> None:  # the bare loop's step (bench_children.py)
        nonlocal loss_sum
        batch = next(plain_batches)
        loss = bare_step(model, optimizer, batch)
        loss_sum += loss.detach()

    def ours() -> None:  # what train.py's loop does per step, but the bookkeeping
        nonlocal loss_sum
        loss, _ = optimizer_step(
            accelerator=accelerator,
            state=state,
            batch=next(our_batches),
            guard=guard,
            clip_norm=clip,
        )
        loss_sum += loss.detach()

    def block(step, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / n

    n = 5 if args.quick else 40
    times: dict[str, list[float]] = {"bare": [], "ours": []}
    sides = {"bare": bare, "ours": ours}
    for round_ in range(1 + (2 if args.quick else 5 * args.repeats)):  # round 0: warm-up
        for name in sides if round_ % 2 else reversed(sides):
            seconds = block(sides[name], n)
            if round_:
                times[name].append(seconds)
    med = {name: statistics.median(values) for name, values in times.items()}
    rounds = len(times["bare"])
    for name, value in med.items():
        print(f"  {name + ' step':<24} {value * 1000:9.2f} ms (median of {rounds} blocks of {n})")
    results["step_ratio"] = med["bare"] / med["ours"]
    results.update({f"{name}_step_ms": value * 1000 for name, value in med.items()})
    # accelerate's state is one per process: the checkpoint part builds its own.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
