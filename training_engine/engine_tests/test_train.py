"""Real training runs of train.py in subprocesses: outputs, determinism, bad input."""

import csv
import hashlib
import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from training_engine.config import instantiate, resolve_config
from training_engine.launch import processes_per_node

from .conftest import FAST, ONE_PROCESS, PROJECT_ROOT, run_train


def test_smoke_run_writes_the_run_directory(train_run, compose_cfg):
    """The project's default as baked (parallel=ddp or fsdp: 2 CPU processes here)."""
    run = train_run(*FAST, as_baked=True)
    d = run.run_dir
    cfg = compose_cfg(*FAST)
    world = processes_per_node(cfg.parallel)
    train_samples = len(instantiate(cfg.data, what="data").train.dataset)
    steps_per_epoch = math.ceil(math.ceil(train_samples / world) / cfg.data.batch_size)
    for name in [
        ".hydra/config.yaml",
        "config.yaml",
        "config.json",
        "train.log",
        "metrics.csv",
        "summary.json",
        "model.safetensors",
    ]:
        assert (d / name).is_file(), name

    # The resolved config: no interpolation left, YAML and JSON say the same.
    config_json = json.loads((d / "config.json").read_text())
    assert "${" not in (d / "config.json").read_text()
    assert "${" not in (d / "config.yaml").read_text()
    assert yaml.safe_load((d / "config.yaml").read_text()) == config_json
    assert config_json["trainer"]["max_steps"] == 30

    s = run.summary
    assert set(s) == {
        "step",
        "epoch",
        "world_size",
        "wall_time_s",
        "steps_per_sec",
        "rates",
        "metrics",
        "best",
        "resumed_from",
        "skipped_nan_steps",
        "recoveries",
        "final_weights",  # the commit record: model.safetensors' size and checksum
    }
    assert s["resumed_from"] is None and s["skipped_nan_steps"] == 0 and s["recoveries"] == []
    assert s["step"] == 30 and s["world_size"] == world
    assert s["epoch"] == math.ceil(30 / steps_per_epoch)  # 2 epochs of 23 steps in one process
    assert s["wall_time_s"] > 0 and s["steps_per_sec"] > 0
    # Whole run and training only, labelled; evaluation and saves are left out of the latter.
    rates = s["rates"]
    assert rates["whole_run"]["seconds"] == s["wall_time_s"]
    assert rates["whole_run"]["steps_per_sec"] == s["steps_per_sec"]
    assert rates["eval_s"] > 0 and rates["ckpt_blocking_s"] > 0
    left = rates["whole_run"]["seconds"] - rates["eval_s"] - rates["ckpt_blocking_s"]
    assert rates["training_only"]["seconds"] == pytest.approx(left, abs=0.002)
    # Seconds are rounded to 1 ms, and this run trains for well under a second:
    # the rate agrees with the rounded seconds to within that rounding.
    trained_s = rates["training_only"]["seconds"]
    rate = rates["training_only"]["steps_per_sec"]
    assert rate == pytest.approx(30 / trained_s, rel=1e-3 + 0.0005 / trained_s)
    global_batch = 64 * world  # data.batch_size per process
    assert rates["training_only"]["samples_per_sec"] == pytest.approx(rate * global_batch, rel=1e-3)
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "val/loss",
        "val/acc",
        "perf/steps_per_sec",
        "perf/samples_per_sec",
    } <= set(s["metrics"])
    assert set(s["best"]) == {"name", "value", "step"}

    # metrics.csv, read with the csv module, agrees with summary.json.
    rows = list(csv.DictReader((d / "metrics.csv").open()))
    assert list(rows[0]) == ["time", "step", "name", "value"]
    val_acc = {int(r["step"]): float(r["value"]) for r in rows if r["name"] == "val/acc"}
    assert sorted(val_acc) == [10, 20, 30]
    train_steps = sorted(int(r["step"]) for r in rows if r["name"] == "train/loss")
    assert train_steps == [5, 10, 15, 20, 25, 30]
    best_step = max(val_acc, key=val_acc.get)
    assert s["best"] == {"name": "val/acc", "value": val_acc[best_step], "step": best_step}
    assert s["metrics"]["val/acc"] == val_acc[30]

    # Not a TTY: progress comes as plain log lines with speed and ETA, also in train.log.
    assert "steps/s | eta" in run.output
    assert "step 30/30" in (d / "train.log").read_text()
    weights = load_file(d / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_seed_gives_identical_weights(train_run, num_workers):
    args = [*FAST, "trainer.max_steps=40", f"data.num_workers={num_workers}"]
    a = load_file(train_run(*args, "seed=7").run_dir / "model.safetensors")
    b = load_file(train_run(*args, "seed=7").run_dir / "model.safetensors")
    c = load_file(train_run(*args, "seed=8").run_dir / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.slow  # ~5 min each on 2 cores: off CI (the same-seed pair above is in CI)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_seed_is_bit_identical_10_times_under_load(tmp_path, num_workers):
    """The guarantee (docs/configuration.md, "Reproducibility"): same seed, same machine, same
    CPU thread count (pinned at start-up) -> the same bits, whatever the load
    and the loader workers. Ten repetitions while another training process
    competes for the cores."""
    load = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            ONE_PROCESS,
            f"hydra.run.dir={tmp_path / 'load'}",
            "preflight=off",
            "tracker=none",
            "checkpoint=none",
            "trainer.max_steps=1000000",
        ],
        cwd=PROJECT_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        args = [*FAST, "trainer.max_steps=40", f"data.num_workers={num_workers}", "seed=7"]
        digests = set()
        for i in range(10):
            run = run_train(tmp_path / f"run{i}", *args)
            assert "CPU threads per process" in run.output
            weights = load_file(run.run_dir / "model.safetensors")
            digests.add(
                hashlib.sha256(b"".join(t.numpy().tobytes() for t in weights.values())).hexdigest()
            )
        assert load.poll() is None  # the load ran the whole time
    finally:
        load.kill()
        load.wait()
    assert len(digests) == 1, f"{len(digests)} different results in 10 runs"


def test_deterministic_mode_matches_default_on_cpu(train_run):
    default = train_run(*FAST, "seed=3").run_dir
    strict = train_run(*FAST, "seed=3", "seeding=deterministic").run_dir
    assert json.loads((strict / "config.json").read_text())["deterministic"] is True
    a, b = load_file(default / "model.safetensors"), load_file(strict / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_other_options_train(train_run):
    run = train_run(
        "trainer.max_epochs=2",
        "model=cnn",
        "optimizer=sgd",
        "scheduler=constant",
        "tracker=none",
        "trainer.mixed_precision=bf16",
        "trainer.grad_accum_steps=2",
    )
    # 1437 training images / 64 per batch = 23 batches = 12 optimizer steps per epoch.
    assert run.summary["step"] == 24 and run.summary["epoch"] == 2
    assert not (run.run_dir / "metrics.csv").exists()
    assert run.summary["metrics"]["val/acc"] > 0.3  # learning, not guessing (0.1)
    assert run.summary["metrics"]["train/lr"] == pytest.approx(0.05)


def test_train_returns_the_best_monitored_metric(compose_cfg, tmp_path):
    """Sweepers optimize what the task function returns."""
    spec = importlib.util.spec_from_file_location("train_script", PROJECT_ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = compose_cfg(ONE_PROCESS, *FAST, "trainer.monitor=val/loss", "trainer.monitor_mode=min")
    value = module.train(resolve_config(cfg), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    val_losses = [float(r["value"]) for r in rows if r["name"] == "val/loss"]
    assert value == summary["best"]["value"] == min(val_losses)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        # torch's optimizer checks its own arguments: the group, its arguments, torch's reason
        (
            "optimizer.lr=-0.1",
            "optimizer: cannot build torch.optim.AdamW(lr=-0.1, weight_decay=0.01): Invalid "
            "learning rate: -0.1",
        ),
        ("data.batch_size=0", "data.batch_size=0 is not allowed: expected an integer >= 1"),
        (
            "trainer.mixed_precision=fp8",
            "trainer.mixed_precision='fp8' is not allowed: expected one of auto, no, bf16, fp16",
        ),
        ("trainer.mixed_precision=fp16", "trainer.mixed_precision='fp16' needs a GPU"),
        ("trainer.monitor=val/f1", "trainer.monitor='val/f1' is not a logged metric"),
        # Hydra's own command-line errors end like ours (entry.py): exit 2, what is allowed
        ("model=resnet", "model=resnet is not an option: choose one of cnn, gpt, hf, mlp"),
        ("tracker=nope", "tracker=nope is not an option: choose one of csv, mlflow, none,"),
        (
            "trainer.max_stepz=5",
            "trainer.max_stepz=5 is not a key of the config: did you mean trainer.max_steps",
        ),
    ],
)
def test_bad_input_fails_before_training_with_a_clear_message(train_run, override, expected):
    run = train_run(*FAST, override, check=False)
    assert run.proc.returncode == 2
    assert expected in run.output
    assert "Traceback" not in run.output
    assert not run.run_dir.exists()  # bad input leaves nothing on disk


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is not None, reason="DeepSpeed is installed here"
)
def test_deepspeed_without_the_package_says_how_to_install_it(train_run):
    run = train_run(*FAST, "parallel=deepspeed", "checkpoint=none", check=False)
    assert run.proc.returncode == 2
    assert "pip install -e '.[deepspeed]'" in run.output


@pytest.mark.slow
@pytest.mark.ci
def test_default_run_reaches_95_percent(train_run):
    """How long it takes is a benchmark's to measure (the template's), not a test's."""
    run = train_run()  # every default, as `python train.py`
    summary = run.summary
    assert summary["metrics"]["val/acc"] >= 0.95
    assert math.isfinite(summary["metrics"]["val/loss"])


def test_the_tasks_default_step_is_accelerates_step_bit_for_bit():
    """The task's default training_step through the engine's Step passes by accelerate's
    accumulate context (one micro-batch per step), its backward's division by 1, its
    clip_grad_norm_ (plain setups) and its wrapper's zero_grad: the same weights and
    norms, bit for bit, as accelerate's own calls."""
    import copy

    from accelerate import Accelerator
    from digit_trainer.tasks.classification import Classification

    from training_engine import step as step_module
    from training_engine.agreement import StepAgreement
    from training_engine.nonfinite import LossGuard
    from training_engine.preemption import StopSignals
    from training_engine.step import Step

    torch.manual_seed(0)
    task = Classification()
    accelerator = Accelerator(cpu=True)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    ours, theirs = net, copy.deepcopy(net)
    ours_opt = accelerator.prepare(torch.optim.AdamW(ours.parameters(), lr=0.1))
    theirs_opt = accelerator.prepare(torch.optim.AdamW(theirs.parameters(), lr=0.1))
    guard = StepAgreement(
        accelerator=accelerator,
        guard=LossGuard("stop", accelerator),
        signals=StopSignals(enabled=False),
        every_n_steps=4,
    )
    verbs = Step(
        accelerator=accelerator,
        agreement=guard,
        clip_norm=0.1,
        models={"model": ours},
        optimizer=ours_opt,
    )
    assert step_module.plain_backward(accelerator)  # the bypass is what is compared
    for step in range(4):
        batch = [torch.randn(32, 8) * (10 if step == 1 else 1), torch.randint(0, 3, (32,))]
        loss, _ = task.training_step(step=verbs, batch=batch)
        assert verbs.update_done()
        norm = verbs.grad_norm
        with accelerator.accumulate(theirs):
            their_loss, _ = task.loss(model=theirs, batch=batch)
            accelerator.backward(their_loss)
            their_norm = accelerator.clip_grad_norm_(theirs.parameters(), 0.1)
            theirs_opt.step()
            theirs_opt.zero_grad(set_to_none=True)
        assert torch.equal(loss, their_loss) and torch.equal(norm, their_norm)
        assert norm > 0.1  # clipping really happened
    guard.at_step(4)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b) and a.grad is None and b.grad is None
