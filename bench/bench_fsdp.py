"""FSDP's figures, measured in one run: the GPT example under 2-process FSDP
through ``train.py`` against a bare FSDP2 loop, and activation checkpointing on
against off.

    python bench/bench_fsdp.py --project DIR           # CPU sizes, 3 rounds of 120 steps
    python bench/bench_fsdp.py --project DIR --quick   # tiny, 1 round (a smoke test)
    python bench/bench_fsdp.py --project DIR --overrides model.n_layer=8 \
        trainer.mixed_precision=bf16

==================  =======================================================================
figure              what
==================  =======================================================================
fsdp_loop_ratio     steps/s of ``torchrun --nproc_per_node 2 train.py parallel=fsdp`` / a
                    bare FSDP2 loop: ``fully_shard`` per block then the root, the same
                    model, data, batch, optimizer, schedule, clipping and precision policy
                    (goal >= 0.95)
ac_ratio            steps/s of the same ``train.py`` with ``parallel.activation_checkpointing
                    =true`` / without: the recompute of each block's forward. A forward is
                    about a third of a step, so about 0.75 is one extra forward and nothing
                    more (on a GPU, where the matmuls dominate; reported, not judged)
==================  =======================================================================

The three sides (2 processes each, under torchrun) run at once and take turns
every 10 optimizer steps (bench_turns.py), so they see the same seconds of
a shared machine; each figure is the median over the rounds. The bare loop is this
file's ``bare`` child; ours is bench_children.py's ``train``.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import bench_project
from bench_children import install_step_clock  # the shared step clock

from bench import compose  # the resolved config train.py would run

GPT = ["model=gpt", "data=tokens"]
SIZES = {
    "quick": [
        *("data.seq_len=32", "data.vocab_size=64", "data.num_train=1024", "data.batch_size=8"),
        *("model.d_model=64", "model.n_layer=2", "model.n_head=2"),
    ],
    "cpu": [
        *("data.seq_len=64", "data.vocab_size=256", "data.num_train=8192", "data.batch_size=16"),
        *("model.d_model=128", "model.n_layer=4", "model.n_head=4"),
    ],
    "gpu": ["trainer.mixed_precision=bf16"],  # the configured size
}


def child_bare(spec: dict) -> None:
    """The floor: ``fully_shard`` on each of ``model.blocks``, then the root (the
    precision policy of fsdp.py), the same optimizer, schedule and clipping, and a
    hand-written step. Every rank trains on batches of the per-process size."""
    install_step_clock(spec["out"], spec.get("turns"))
    import torch
    import torch.distributed as dist
    from bench_children import _build, bare_model_node
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    precision_policies = bench_project.module("engine.fsdp").precision_policies

    cfg, steps = spec["config"], spec["steps"]
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(cfg["seed"])  # the same initial weights on every rank
    loaders = _build(cfg["data"])
    model = _build(bare_model_node(cfg["model"]))
    block_mp, root_mp = precision_policies(cfg["trainer"]["mixed_precision"])
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # one, as torchtitan's
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=block_mp)
    fully_shard(model, mesh=mesh, mp_policy=root_mp)
    if cfg["trainer"].get("compile"):
        model = torch.compile(model)
    task = _build(cfg["task"])
    # the task's groups, as train.py builds the optimizer (no decay on norms and biases)
    optimizer = _build(cfg["optimizer"])(task.param_groups(model))
    scheduler = _build(cfg["scheduler"])(optimizer, total_steps=steps)
    clip = cfg["trainer"]["grad_clip_norm"]
    torch.manual_seed(cfg["seed"] + dist.get_rank())  # each rank its own batches
    done = 0
    while done < steps:
        for batch in loaders.train:
            batch = [t.to(device, non_blocking=True) for t in batch]
            loss, _ = task.loss(model=model, batch=batch)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            done += 1
            if done == steps:
                break
    dist.destroy_process_group()


def in_turns(args, overrides: list[str], work: Path) -> dict[str, float]:
    """``args.repeats`` rounds of ours, ours with activation checkpointing and the
    bare loop (2 processes each), in turns of 10 steps; medians of steps/s and ratios."""
    from bench_turns import run_in_turns

    every = min(10, max(1, args.steps // 4))
    blocks = args.steps // every
    steps, untimed = blocks * every, -(-max(2, args.steps // 10) // every)
    run = [*overrides, "parallel=fsdp", f"trainer.max_steps={steps}"]
    run += [f"trainer.eval_every_n_steps={steps}", "trainer.log_every_n_steps=10"]
    run += ["preflight=off", "checkpoint=none"]
    config = compose(run)
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone"]
    torchrun += ["--nproc_per_node", "2"]
    sides = {"ours": ["parallel.activation_checkpointing=false"]}
    sides["ours_ac"] = ["parallel.activation_checkpointing=true"]
    sides["bare"] = []
    rounds: dict[str, list[float]] = {name: [] for name in [*sides, "loop", "ac"]}
    for round_ in range(args.repeats):
        folder = work / f"turns-{round_}"
        folder.mkdir()
        commands = {}
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for side in order:
            turns = {"folder": str(folder), "side": side, "every": every}
            spec: dict = {"steps": steps, "out": str(folder / f"{side}.json"), "turns": turns}
            if side == "bare":
                spec["config"] = config
                script, kind = Path(__file__).resolve(), "bare"
            else:
                spec["overrides"] = [*run, *sides[side], f"hydra.run.dir={folder / side}"]
                script, kind = Path(__file__).resolve().with_name("bench_children.py"), "train"
            (folder / f"{side}.spec.json").write_text(json.dumps(spec))
            commands[side] = [*torchrun, str(script), kind, str(folder / f"{side}.spec.json")]
        seconds = run_in_turns(
            commands,
            folder,
            ranks=2,
            every=every,
            blocks=blocks,
            untimed=untimed,
            cwd=bench_project.root(),
        )
        for side in sides:
            taken = len(json.loads((folder / f"{side}.json.rank0").read_text())["times"])
            if taken != steps:
                raise SystemExit(f"bench: {side} took {taken} optimizer steps, not {steps}")
            rounds[side].append(every * len(seconds[side]) / sum(seconds[side]))
        rounds["loop"].append(rounds["ours"][-1] / rounds["bare"][-1])
        rounds["ac"].append(rounds["ours_ac"][-1] / rounds["ours"][-1])
        print(
            f"  round {round_ + 1}/{args.repeats}: ours {rounds['ours'][-1]:.2f}, ours with AC "
            f"{rounds['ours_ac'][-1]:.2f}, bare {rounds['bare'][-1]:.2f} steps/s; fsdp_loop_ratio "
            f"{rounds['loop'][-1]:.3f}, ac_ratio {rounds['ac'][-1]:.3f}",
            flush=True,
        )
        shutil.rmtree(folder, ignore_errors=True)
    return {name: statistics.median(values) for name, values in rounds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_project.add_option(parser)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round")
    parser.add_argument("--repeats", type=int, help="rounds (default 3; quick: 1)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (120; quick: 20)")
    parser.add_argument("--overrides", nargs="*", default=[], help="Hydra overrides, added")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    bench_project.use_option(parser, args)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.steps = args.steps or (20 if args.quick else 120)
    import torch

    where = "quick" if args.quick else ("gpu" if torch.cuda.is_available() else "cpu")
    overrides = [*GPT, *SIZES[where], *args.overrides]
    print(f"workload: {' '.join(overrides)}; 2-process FSDP; {args.repeats} round(s)")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    work = Path(tempfile.mkdtemp(prefix="bench_fsdp_", dir=bench_project.root()))
    try:
        medians = in_turns(args, overrides, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {
        "fsdp_loop_ratio": medians["loop"],
        "ac_ratio": medians["ac"],
        "ours_steps_per_sec": medians["ours"],
        "ours_ac_steps_per_sec": medians["ours_ac"],
        "bare_steps_per_sec": medians["bare"],
    }
    print(f"\nfsdp_loop_ratio {results['fsdp_loop_ratio']:.3f}   (goal >= 0.95)")
    print(f"ac_ratio        {results['ac_ratio']:.3f}   (one extra forward: about 0.75)")
    if args.json:
        args.json.write_text(json.dumps({"overrides": overrides, **results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "bare":  # a child, under torchrun
        child_bare(json.loads(Path(sys.argv[2]).read_text()))
    else:
        sys.exit(main())
