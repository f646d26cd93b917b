"""Time our checkpoint save/load against raw torch.save/torch.load of the same state.

    python scripts/bench_checkpoint.py                   # ~4M-parameter MLP + AdamW state
    python scripts/bench_checkpoint.py --width 2048 --dir /scratch/bench

Ours = the full protocol: serialize, write + fsync + sha256 of every file,
MANIFEST.json, rename, fsync of the folder, pointers, pruning; load = read,
verify every sha256, parse (safetensors / weights_only) and apply to the
model, optimizer and scheduler. Raw = one ``torch.save`` of the same state
dicts to the same disk (no fsync, no hashes), and ``torch.load`` + apply. The
ratios are of medians over ``--repeats`` runs. A second raw baseline adds an
fsync, the price of durability that any crash-safe save pays.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from omegaconf import OmegaConf
from torch import nn

from {{ cookiecutter.package_name }}.checkpoint import CheckpointManager, rng_state


def build(width: int, depth: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    model = nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(8, 64)).sum().backward()  # one step: the optimizer state exists
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4, help="hidden width x width layers")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: ./)")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir or Path.cwd()))
    try:
        accelerator = Accelerator(cpu=True)
        model, optimizer, scheduler = build(args.width, args.depth)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        params = sum(p.numel() for p in model.parameters())
        cfg = OmegaConf.create(
            {"seed": 0, "checkpoint": {"enabled": True, "keep_last": 2, "save_on_signal": False}}
        )
        manager = CheckpointManager(
            cfg, base / "ours", accelerator, model, optimizer, scheduler, [None]
        )
        raw_path = base / "raw" / "state.pt"
        raw_path.parent.mkdir(parents=True)

        def raw_state() -> dict:
            return {
                "model": accelerator.unwrap_model(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": rng_state(),
            }

        def raw_save() -> None:
            torch.save(raw_state(), raw_path)

        def raw_save_fsync() -> None:
            with open(raw_path, "wb") as f:
                torch.save(raw_state(), f)
                f.flush()
                os.fsync(f.fileno())

        def raw_load() -> None:
            state = torch.load(raw_path, map_location="cpu", weights_only=True)
            accelerator.unwrap_model(model).load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])

        step = iter(range(1, 10**6))
        saved: list[Path] = []

        def our_save() -> None:
            saved.append(manager.save(next(step), 0, 0, ["bench"]))

        def our_load() -> None:
            manager.load(saved[-1])  # read, verify sha256s, parse, apply

        times: dict[str, list[float]] = {}
        for _ in range(args.repeats + 1):  # the first round warms up and is dropped
            for name, fn in [
                ("raw save", raw_save),
                ("raw save+fsync", raw_save_fsync),
                ("our save", our_save),
                ("raw load", raw_load),
                ("our load", our_load),
            ]:
                times.setdefault(name, []).append(timed(fn))
        med = {name: statistics.median(values[1:]) for name, values in times.items()}
        size = sum(p.stat().st_size for p in saved[-1].iterdir()) / 2**20
        print(f"{params:,} parameters, checkpoint {size:.1f} MB, in {base}")
        print(f"medians of {args.repeats} repeats:")
        for name, value in med.items():
            print(f"  {name:<16} {value * 1000:8.1f} ms")
        print(
            f"save ratio (ours / raw torch.save):        {med['our save'] / med['raw save']:.2f}x"
        )
        print(
            "save ratio (ours / raw torch.save+fsync):  "
            f"{med['our save'] / med['raw save+fsync']:.2f}x"
        )
        print(
            f"load ratio (ours, verified / torch.load):  {med['our load'] / med['raw load']:.2f}x"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
