"""Performance features with real runs: async checkpoints (also under SIGTERM and
SIGKILL) and the GPT example compiled on CPU. What they cost against bare PyTorch
is measured by the template's own bench, not here (timed tests mean nothing on
shared CI machines)."""

import csv
import json
import math
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from training_engine.adapters import base_node
from training_engine.checkpoint import committed_checkpoints, verify_checkpoint
from training_engine.config import (
    ConfigError,
    check_config,
    instantiate,
    resolve_config,
)

from .conftest import run_train
from .test_checkpoint import (
    ARGS,
    assert_same_weights,
    ckpt_dir,
    kill_when_paused,
    start_train,
    steps_in,
    wait_until,
)

ASYNC = "checkpoint.async_save=true"
KEEP_ALL = "checkpoint.keep_last=100"  # every checkpoint stays, to compare them all
# A GPT small enough to train a few dozen steps on a CPU in seconds.
TINY_GPT = [
    "model=gpt",
    "data=tokens",
    "data.seq_len=32",
    "data.vocab_size=32",
    "data.num_train=512",
    "data.num_val=64",
    "data.batch_size=16",
    "model.d_model=64",
    "model.n_layer=2",
    "model.n_head=2",
    "optimizer.lr=3e-3",
    "tracker=csv",
]


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory) -> Path:
    """An uninterrupted run with synchronous checkpoints, all of them kept."""
    run_dir = tmp_path_factory.mktemp("sync") / "run"
    run_train(run_dir, *ARGS, KEEP_ALL)
    return run_dir


def tensors(path: Path) -> dict:
    """Every tensor and value of a torch file, by its path in the nested state."""
    flat = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}/{key}")
        else:
            flat[prefix] = node

    walk(torch.load(path, weights_only=True), "")
    return flat


def trainer_state(ckpt: Path) -> dict:
    """trainer_state.json without the timings (perf/*, the run's clock), which differ."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["stateful"].pop("clock", None)
    last = state["stateful"]["metrics"]["last"]
    state["stateful"]["metrics"]["last"] = {k: v for k, v in last.items() if "perf/" not in k}
    return state


@pytest.mark.multiprocess
def test_async_checkpoints_hold_the_state_of_their_step(sync_reference, tmp_path):
    """The background writer of step 14 pauses for 2 s before it serializes the
    optimizer state, while training goes on: the files must still hold step
    14's state (staged copies, not the live tensors). Every checkpoint of the
    async run equals the sync run's: weights, optimizer state, trainer state."""
    run = tmp_path / "run"
    proc = start_train(run, *ARGS, ASYNC, KEEP_ALL, pause_at="between_files@14+2")
    assert proc.wait(timeout=300) == 0, Path(f"{run}.out").read_text()[-3000:]
    output = Path(f"{run}.out").read_text()
    assert "CKPT_TEST_PAUSED between_files step 14" in output
    assert "(every_n_steps; async)" in output  # the saves did run in the background
    assert steps_in(run) == steps_in(sync_reference)
    for step in steps_in(run):
        ours, theirs = ckpt_dir(run, step), ckpt_dir(sync_reference, step)
        assert verify_checkpoint(ours) is None
        assert_same_weights(ours, theirs)
        a, b = tensors(ours / "optimizer.pt"), tensors(theirs / "optimizer.pt")
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)
        assert trainer_state(ours) == trainer_state(theirs)
    assert_same_weights(run, sync_reference)


@pytest.mark.multiprocess
def test_sigterm_waits_for_the_async_save_and_resumes(sync_reference, tmp_path):
    """SIGTERM during an async run: the save in flight finishes, the stop
    checkpoint is written and committed, exit 143; the resumed run ends with
    the uninterrupted run's weights."""
    run = tmp_path / "run"
    proc = start_train(run, *ARGS, ASYNC)
    wait_until(lambda: ckpt_dir(run, 14).is_dir() or proc.poll() is not None, what="step 14")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    output = Path(f"{run}.out").read_text()
    stopped = max(steps_in(run))
    assert f"checkpoint saved at {ckpt_dir(run, stopped)}" in output
    assert all(verify_checkpoint(p) is None for p in committed_checkpoints(run / "checkpoints"))
    assert not list((run / "checkpoints").glob("*.tmp"))

    resumed = run_train(run, *ARGS, ASYNC)
    assert resumed.summary["resumed_from"] == str(ckpt_dir(run, stopped))
    assert_same_weights(run, sync_reference)
    pointer = json.loads((run / "checkpoints" / "latest.json").read_text())
    assert pointer == {"step": 80, "path": "step_0000080"}
    assert all(verify_checkpoint(p) is None for p in committed_checkpoints(run / "checkpoints"))


@pytest.mark.multiprocess
def test_sigkill_during_async_saves_leaves_only_valid_checkpoints(sync_reference, tmp_path):
    """SIGKILL while the background thread writes (between files) and before
    its commit (the rename), each while training has gone on: only complete,
    verified checkpoints remain, and the restarted run ends with the weights of
    the uninterrupted one."""
    run = tmp_path / "run"
    for moment, step in [("between_files", 14), ("before_rename", 35)]:
        kill_when_paused(run, moment, step, *ARGS, ASYNC)
        root = run / "checkpoints"
        assert (root / f"step_{step:07d}.tmp").is_dir()  # the save in flight: never committed
        assert step not in steps_in(run) and step - 7 in steps_in(run)
        assert all(verify_checkpoint(p) is None for p in committed_checkpoints(root))
    newest = max(steps_in(run))
    done = run_train(run, *ARGS, ASYNC)
    assert f"resumed from {ckpt_dir(run, newest)}" in done.output
    assert not list((run / "checkpoints").glob("*.tmp"))
    assert_same_weights(run, sync_reference)


@pytest.mark.multiprocess
def test_async_checkpoints_under_ddp(tmp_path):
    """Two processes: every rank stages and writes its own files in the
    background; rank 0 commits once rank 1's file is there (no collective runs
    off the main thread, so nothing can deadlock). Rank 0's writer pauses 1 s at
    step 14 while both ranks train on. The weights equal a sync DDP run's."""
    ddp = ["parallel=ddp", "parallel.num_processes=2", *ARGS, KEEP_ALL]
    sync = run_train(tmp_path / "sync", *ddp)
    run = run_train(tmp_path / "async", *ddp, ASYNC, pause_at="between_files@14+1")
    assert "CKPT_TEST_PAUSED between_files step 14" in run.output
    assert "(every_n_steps; async)" in run.output
    assert run.summary["world_size"] == 2
    assert steps_in(run.run_dir) == steps_in(sync.run_dir)
    for step in steps_in(run.run_dir):
        ckpt = ckpt_dir(run.run_dir, step)
        assert verify_checkpoint(ckpt) is None
        assert {"rng_rank0.pt", "rng_rank1.pt"} <= {p.name for p in ckpt.iterdir()}
        assert_same_weights(ckpt, ckpt_dir(sync.run_dir, step))
    assert_same_weights(run.run_dir, sync.run_dir)
    assert not list((run.run_dir / "checkpoints").glob("*.tmp"))


@pytest.mark.slow  # compiling takes ~20 s on a CPU
def test_gpt_example_compiled_trains_on_cpu_and_reports_tokens_and_mfu(train_run, monkeypatch):
    monkeypatch.setenv("TORCH_LOGS", "dynamo")  # torch says what it compiles
    run = train_run(
        *TINY_GPT,
        "trainer.compile=true",
        "data.val_batch_size=16",  # the training shape: no recompiling for another one
        "trainer.max_steps=60",
        "trainer.log_every_n_steps=10",
        "trainer.eval_every_n_steps=30",
        "trainer.peak_tflops=0.5",  # a CPU has no known peak: give one, so MFU is reported
    )
    assert "start tracing forward" in run.output and "gpt.py" in run.output
    assert "calling compiler function inductor" in run.output
    # The compiled wrapper leaves no trace in the weights' names.
    names = set(load_file(run.run_dir / "model.safetensors"))
    assert "head.weight" in names and not any("_orig_mod" in n for n in names)
    rows = list(csv.DictReader((run.run_dir / "metrics.csv").open()))

    def series(name: str) -> dict[int, float]:
        return {int(r["step"]): float(r["value"]) for r in rows if r["name"] == name}

    loss = series("train/loss")
    assert sorted(loss) == [10, 20, 30, 40, 50, 60]
    assert loss[60] < 0.7 * loss[10] and loss[60] < math.log(32), loss  # below a uniform guess
    val = series("val/acc")
    assert val[60] > 2 / 32  # well above chance
    # Throughput: 16 sequences x 32 tokens per step; MFU = FLOPs/s over the given peak.
    steps_per_sec, tokens = series("perf/steps_per_sec"), series("perf/tokens_per_sec")
    assert tokens[60] == pytest.approx(steps_per_sec[60] * 16 * 32)
    flops_per_token = 6 * (2 * 12 * 64 * 64 + 64 * 32) + 12 * 2 * 64 * 32
    mfu = series("perf/mfu")[60]
    assert mfu == pytest.approx(tokens[60] * flops_per_token / 0.5e12)
    assert 0 < mfu < 1
    assert set(run.summary["metrics"]) >= {"perf/tokens_per_sec", "perf/mfu"}
    # Its checkpoint resumes without compiling (trainer.compile may change on resume).
    eager = run_train(
        run.run_dir,
        *TINY_GPT,
        "data.val_batch_size=16",
        "trainer.max_steps=70",
        "trainer.eval_every_n_steps=30",
    )
    assert f"resumed from {run.run_dir / 'checkpoints' / 'step_0000060'}" in eager.output
    assert eager.summary["step"] == 70 and "start tracing forward" not in eager.output


def test_new_config_values_are_checked(compose_cfg):
    # The example model and data check their own arguments when built.
    model_and_data = {
        ("model.n_head=3",): "model.d_model=64 is not allowed: expected a multiple of "
        "model.n_head=3",
        ("data.branching=40",): "data.branching=40 is not allowed: expected at most "
        "data.vocab_size=32",
    }
    for overrides, message in model_and_data.items():
        cfg = resolve_config(compose_cfg(*TINY_GPT, *overrides))
        check_config(cfg)  # the infrastructure's keys are fine
        with pytest.raises(ConfigError) as err:
            instantiate(cfg.data)
            instantiate(base_node(cfg.model))  # the model's node less model.peft
        assert message in str(err.value)
    cases = {
        ("checkpoint.async_save=maybe",): "checkpoint.async_save='maybe' is not allowed: "
        "expected true or",
        ("trainer.compile=sometimes",): "trainer.compile='sometimes' is not allowed: expected "
        "true or false",
        ("trainer.peak_tflops=0",): "trainer.peak_tflops=0 is not allowed: expected a number > 0",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError) as err:
            check_config(resolve_config(compose_cfg(*TINY_GPT, *overrides)))
        assert message in str(err.value)
    check_config(resolve_config(compose_cfg(*TINY_GPT, ASYNC, "trainer.compile=true")))
