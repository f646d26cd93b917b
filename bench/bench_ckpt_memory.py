"""``bench.py --only ckpt_memory``: peak resident memory per rank while saving and
loading the same model + AdamW state under 2-process FSDP, ``checkpoint.format``
full against sharded. Run by bench.py; each rank is this file run as a script
(``python bench/bench_ckpt_memory.py SPEC``, the rank in its environment)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import bench_project

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

    build_accelerator = bench_project.module("engine.accel").build_accelerator
    fmt = bench_project.module("engine.checkpoint.format")
    protocol = bench_project.module("engine.checkpoint.save")
    full_state = bench_project.module("engine.checkpoint.full_state")
    sharded = bench_project.module("engine.checkpoint.sharded")
    shard_model = bench_project.module("engine.fsdp").shard_model

    cfg = OmegaConf.create(spec["config"])
    acc = build_accelerator(cfg, Path(spec["dir"]))
    width, layers = spec["width"], spec["layers"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model = shard_model(model, accelerator=acc, parallel=cfg.parallel)  # a unit per layer
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
            protocol.write_main_files(folder, 0, tensors, {})
        elif layout == "sharded":
            sharded.write(folder, *shards, 0)
            if acc.is_main_process:
                (folder / fmt.OPTIMIZER_GROUPS).write_bytes(extra[fmt.OPTIMIZER_GROUPS])
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
            groups = json.loads((folder / fmt.OPTIMIZER_GROUPS).read_text())
            loaded = {fmt.OPTIMIZER_GROUPS: groups}
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


def bench_ckpt_memory(args, compose, work: Path, results: dict) -> None:
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
        cmd = [sys.executable, str(Path(__file__).resolve()), str(folder / "spec.json")]
        out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        procs.append(subprocess.Popen(cmd, cwd=bench_project.root(), env=env, **out))
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


if __name__ == "__main__":
    _child_ckpt_memory(json.loads(Path(sys.argv[1]).read_text()))
