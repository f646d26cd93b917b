"""``bench.py``'s checkpoint figures, in this process: our save and load against
``torch.save`` (+ fsync) and ``torch.load`` + ``load_state_dict`` of the same
state, and the time an async save blocks against a sync one."""

import os
import statistics
import time
from pathlib import Path

import bench_project


def bench_checkpoint(args, config: dict, work: Path, results: dict) -> None:
    """Our save/load against torch.save/torch.load of the same state, and the
    time an async save blocks against a sync one, in this process."""
    import torch
    from accelerate import Accelerator
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    CheckpointManager = bench_project.module("engine.checkpoint").CheckpointManager
    state_module = bench_project.module("engine.state")
    TrainState, rng_state = state_module.TrainState, state_module.rng_state

    cfg = OmegaConf.create(config)  # the resolved config of the workload
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    task = instantiate(cfg.task)
    model = instantiate(bench_project.module("engine.adapters").base_node(cfg.model))  # no peft
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=100)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    batch = [t.to(accelerator.device) for t in next(iter(instantiate(cfg.data).train))]
    task.loss(model=model, batch=batch)[0].backward()
    optimizer.step()  # the optimizer state exists
    scheduler.step()

    state = TrainState(model, optimizer, scheduler, train_loader=[], val_loader=[])

    def manager(asynchronous: bool) -> CheckpointManager:
        settings = {"enabled": True, "keep_last": 2, "save_on_signal": False}
        return CheckpointManager(
            checkpoint={**settings, "async_save": asynchronous},
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
                # Nothing dirty left by the previous step (the raw save without
                # fsync leaves 217 MB): the next one's fsyncs would write it out.
                os.sync()
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
    results["save_ratio"] = med["our save"] / med["raw save+fsync"]
    results["save_vs_raw_ratio"] = med["our save"] / med["raw save"]
    results["load_ratio"] = med["our load"] / med["raw load"]
    results["async_block_ratio"] = med["async save (blocking)"] / med["our save"]
    results["checkpoint_mb"] = size
    results.update({f"{k.replace(' ', '_')}_ms": v * 1000 for k, v in med.items()})
