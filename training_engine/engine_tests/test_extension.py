"""Ten ordinary changes, each made the way docs/own-model.md tells a user to: the
owner's code (engine_tests/user_code.py stands for files under src/) and config values on the
command line, never an edit to train.py or the engine. Each asserts its outcome."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import ENV, FAST, PROJECT_ROOT, fingerprints, require_trackers, run_train, wait_for

USER = "engine_tests.user_code"
PKG = "digit_trainer"


def metric_rows(run_dir: Path, name: str) -> list[tuple[int, float]]:
    with open(run_dir / "metrics.csv") as f:
        return [(int(r["step"]), float(r["value"])) for r in csv.DictReader(f) if r["name"] == name]


def test_a_metric_over_the_whole_set(train_run):
    run = train_run(*FAST, f"task._target_={USER}.WithF1", "trainer.monitor=val/f1")
    f1 = metric_rows(run.run_dir, "val/f1")
    assert [s for s, _ in f1] == [10, 20, 30] and 0.3 < f1[-1][1] <= 1.0
    assert run.summary["best"]["name"] == "val/f1"


def test_a_schedule_that_steps_on_a_metric(train_run):
    """ReduceLROnPlateau on val/acc in min mode: accuracy rises, so every evaluation after
    the first is no improvement and the learning rate halves (patience 0)."""
    run = train_run(
        *FAST,
        "scheduler=plateau",
        "scheduler.patience=0",
        "trainer.monitor=val/acc",
        "trainer.monitor_mode=min",
        "trainer.eval_every_n_steps=5",
        "trainer.log_every_n_steps=1",
    )
    lrs = dict(metric_rows(run.run_dir, "train/lr"))
    acc = dict(metric_rows(run.run_dir, "val/acc"))
    assert lrs[1] == lrs[10] == 3e-3  # between evaluations, and at the first (the best so far)
    for at in (10, 15, 20, 25):  # after an evaluation that did not beat the best (min): halved
        worse = acc[at] >= min(v for s, v in acc.items() if s < at)
        assert lrs[at + 1] == pytest.approx(lrs[at] * (0.5 if worse else 1.0))
    assert lrs[30] < lrs[1]


def test_freezing_the_first_layer(train_run):
    run = train_run(*FAST, f"task._target_={USER}.FreezeFirst", "+task.frozen_layers=1")
    first = sorted((run.run_dir / "checkpoints").glob("step_*"))[0]
    start = load_file(first / "model.safetensors")  # step 10: after 10 updates
    end = load_file(run.run_dir / "model.safetensors")
    assert torch.equal(start["net.1.weight"], end["net.1.weight"])  # frozen: never moved
    assert not torch.equal(start["net.4.weight"], end["net.4.weight"])  # trained
    groups = torch.load(first / "optimizer.pt", weights_only=True)["param_groups"]
    assert sum(len(g["params"]) for g in groups) == 4  # 6 tensors, 2 frozen


def test_a_custom_collate_with_dict_batches(train_run):
    run = train_run(
        *FAST,
        f"data._target_={USER}.dict_digits",
        f"task._target_={USER}.DictBatches",
    )
    assert run.summary["metrics"]["val/acc"] > 0.5


def test_two_optimizers_with_their_own_learning_rates(train_run):
    """The head's optimizer has lr 0: its weights never move, the body's do; both
    optimizers' states are in the checkpoint, by name."""
    run = train_run(
        *FAST,
        f"task._target_={USER}.TwoLearningRates",
        "+optimizers.head._target_=torch.optim.SGD",
        "+optimizers.head._partial_=true",
        "+optimizers.head.lr=0.0",
    )
    first = sorted((run.run_dir / "checkpoints").glob("step_*"))[0]
    start, end = (
        load_file(first / "model.safetensors"),
        load_file(run.run_dir / "model.safetensors"),
    )
    assert torch.equal(start["net.7.weight"], end["net.7.weight"])
    assert not torch.equal(start["net.1.weight"], end["net.1.weight"])
    saved = torch.load(first / "optimizer.pt", weights_only=True)
    assert sorted(saved) == ["head", "optimizer"]
    assert saved["head"]["param_groups"][0]["lr"] == 0.0
    assert saved["optimizer"]["state"]  # AdamW's moments


def test_an_image_at_every_evaluation_reaches_tensorboard(train_run):
    require_trackers("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train_run(*FAST, "callbacks=prediction_grid", "tracker=[csv,tensorboard]")
    events = EventAccumulator(str(run.run_dir / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    images = events.Images("val/predictions")
    assert [i.step for i in images] == [10, 20, 30]
    assert images[0].width == 8 * 10 and images[0].height == 2 * 10  # 16 images, 8 a row
    assert (run.run_dir / "media" / "step_0000030" / "val" / "predictions.png").is_file()


def test_samples_written_by_a_callback_at_every_evaluation(train_run):
    small = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "data.num_train=256"]
    run = train_run(*FAST, "model=gpt", "data=tokens", *small, "callbacks=generate_samples")
    samples = sorted((run.run_dir / "samples").glob("step_*.txt"))
    assert [p.name for p in samples] == [f"step_{s:07d}.txt" for s in (10, 20, 30)]
    prompt, new = samples[-1].read_text().split("->")
    assert len(prompt.split()) == 16 and len(new.split()) == 32  # ids: data=tokens


def test_a_multi_task_loss(train_run):
    run = train_run(
        *FAST,
        "trainer.max_steps=60",
        f"model._target_={USER}.TwoHeads",
        "~model.in_features",
        "~model.num_classes",
        "~model.depth",
        "~model.dropout",
        "model.width=64",
        f"task._target_={USER}.MultiTask",
    )
    metrics = run.summary["metrics"]
    assert metrics["val/parity_acc"] > 0.7 and metrics["val/acc"] > 0.5
    assert metrics["val/loss"] == pytest.approx(
        metrics["val/digit_loss"] + 0.5 * metrics["val/parity_loss"], rel=1e-6
    )


def test_distillation_from_a_frozen_teacher(train_run, tmp_path):
    """The teacher is another run, loaded with load_model: never trained, never saved."""
    teacher = train_run(*FAST)
    run = train_run(
        *FAST,
        "trainer.max_steps=60",
        f"task._target_={USER}.Distill",
        "+frozen_models.teacher._target_=training_engine.inference.load_model",
        f"+frozen_models.teacher.path={teacher.run_dir}",
    )
    assert run.summary["metrics"]["train/agreement"] > 0.7  # the student follows it
    saved = load_file(run.run_dir / "model.safetensors")
    assert sorted(saved) == sorted(load_file(teacher.run_dir / "model.safetensors"))  # one model
    last = sorted((run.run_dir / "checkpoints").glob("step_*"))[-1]
    assert not [p for p in last.iterdir() if "teacher" in p.name]


GAN = [
    f"model._target_={USER}.GAN",
    "~model.in_features",
    "~model.num_classes",
    "~model.width",
    "~model.depth",
    "~model.dropout",
    f"task._target_={USER}.GANTask",
    "+optimizers.discriminator._target_=torch.optim.Adam",
    "+optimizers.discriminator._partial_=true",
    "+optimizers.discriminator.lr=2e-4",
    "optimizer.lr=2e-4",
    "trainer.monitor=val/g_loss",
    "trainer.monitor_mode=min",
    "trainer.grad_clip_norm=null",
    "scheduler=constant",
]


@pytest.mark.multiprocess
def test_a_gan_under_ddp_resumes_bit_exactly_after_kill_9(tmp_path):
    """Two networks, two optimizers, one step of each per batch, 2 processes; the
    launcher killed with SIGKILL after a checkpoint, the same command again: the final
    weights of both networks equal an uninterrupted run's."""
    args = [
        *GAN,
        "parallel=ddp",
        "parallel.find_unused_parameters=true",  # each forward uses one network
        "trainer.max_steps=60",
        "checkpoint.every_n_steps=20",
        "trainer.eval_every_n_steps=20",
        "tracker=csv",
        "preflight=off",
        f"+callbacks.counter._target_={USER}.EvalCounter",  # a callback with state
    ]
    straight = run_train(tmp_path / "straight", *args)
    assert straight.summary["world_size"] == 2
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *args]
    slow = ["model._target_=engine_tests.user_code.SlowGAN"]
    launcher = subprocess.Popen(
        [*cmd, *slow],
        cwd=PROJECT_ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(run_dir / "checkpoints" / "step_0000020")
    launcher.kill()
    assert launcher.wait(timeout=60) == -9
    resumed = run_train(run_dir, *args, *slow)
    assert Path(resumed.summary["resumed_from"]).name in ("step_0000020", "step_0000040")
    a, b = (
        load_file(straight.run_dir / "model.safetensors"),
        load_file(run_dir / "model.safetensors"),
    )
    assert sorted(a) == sorted(b) and any(k.startswith("discriminator.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert fingerprints(run_dir)["train.log"] == fingerprints(straight.run_dir)["train.log"]
    opt = torch.load(
        sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "optimizer.pt", weights_only=True
    )
    assert sorted(opt) == ["discriminator", "optimizer"]
    state = json.loads((run_dir / "checkpoints/step_0000060/trainer_state.json").read_text())
    assert state["stateful"]["callbacks.counter"] == {"count": 3}  # 20, 40, 60: restored

    # elastic 2 -> 1 with named optimizers: the finished run extended to step 80 on one
    # process (2 micro-batches a step keep the global batch); both optimizers continue
    one = [a for a in args if not a.startswith("parallel")] + ["parallel=none", *slow]
    extended = run_train(run_dir, *one, "trainer.max_steps=80")
    assert extended.summary["world_size"] == 1 and extended.summary["step"] == 80
    assert Path(extended.summary["resumed_from"]).name == "step_0000060"
    opt = torch.load(run_dir / "checkpoints/step_0000080/optimizer.pt", weights_only=True)
    for name in ("optimizer", "discriminator"):  # Adam's per-parameter step: 60 + 20
        assert {float(s["step"]) for s in opt[name]["state"].values()} == {80.0}, name


@pytest.mark.multiprocess
def test_two_optimizers_on_the_gpt_under_fsdp_resume_bit_exactly(tmp_path):
    """FSDP (2 processes, sharded checkpoints): AdamW on the matrices, a second AdamW
    with another learning rate on the rest; resumed from its step-10 checkpoint, the
    same weights as the uninterrupted run."""
    args = [
        "model=gpt",
        "data=tokens",
        "model.n_layer=2",
        "model.d_model=64",
        "model.n_head=2",
        "data.num_train=512",
        "parallel=fsdp",
        f"task._target_={USER}.SplitGPT",
        "+optimizers.rest._target_=torch.optim.AdamW",
        "+optimizers.rest._partial_=true",
        "+optimizers.rest.lr=1e-3",
        "trainer.max_steps=20",
        "checkpoint.every_n_steps=10",
        "trainer.eval_every_n_steps=10",
        "tracker=csv",
        "preflight=off",
        "scheduler=constant",
    ]
    straight = run_train(tmp_path / "straight", *args)
    run_dir = tmp_path / "resumed"
    run_train(run_dir, *args, "trainer.max_steps=10")
    manifest = json.loads((run_dir / "checkpoints/step_0000010/MANIFEST.json").read_text())
    assert manifest["layout"] == "sharded"
    resumed = run_train(run_dir, *args)
    assert Path(resumed.summary["resumed_from"]).name == "step_0000010"
    a, b = (
        load_file(straight.run_dir / "model.safetensors"),
        load_file(run_dir / "model.safetensors"),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
