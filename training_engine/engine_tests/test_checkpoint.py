"""Checkpoints with real training processes, real signals and real disks: layout,
pruning, resume (auto, path, never), bit-exact continuation, integrity,
safety, config compatibility, disk errors, NaN handling and the CLI."""

import contextlib
import hashlib
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from training_engine.checkpoint import (
    CheckpointError,
    committed_checkpoints,
    load_tensors_safely,
    verify_checkpoint,
)
from training_engine.checkpoint import format as fmt
from training_engine.checkpoint.__main__ import main as checkpoint_cli
from training_engine.config import ConfigError, check_config, resolve_config

from .conftest import ONE_PROCESS, PROJECT_ROOT, TRAIN_WITH_FAULTS, fingerprints, run_train

# 80 steps over 4 epochs of 23 batches; checkpoints every 7 steps (mid-epoch),
# on each new best val/acc (evaluated every 10 steps) and at the end.
ARGS = [
    "trainer.max_steps=80",
    "trainer.log_every_n_steps=5",
    "trainer.eval_every_n_steps=10",
    "checkpoint.every_n_steps=7",
]
BATCHES_PER_EPOCH = 23


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors" if path.is_dir() else path)


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"tensors differ: {different}"


def ckpt_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:07d}"


def steps_in(run_dir: Path) -> list[int]:
    return [int(p.name[5:]) for p in committed_checkpoints(run_dir / "checkpoints")]


def start_train(run_dir: Path, *overrides: str, pause_at: str | None = None) -> subprocess.Popen:
    """Start train.py without waiting; stdout+stderr go to RUN_DIR.out. With
    ``pause_at`` (CKPT_TEST_PAUSE_AT), through engine_tests/train_with_faults.py."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    out = open(f"{run_dir}.out", "ab")  # noqa: SIM115 (closed by the child's exit)
    script = TRAIN_WITH_FAULTS if pause_at else "train.py"
    env = {"CKPT_TEST_PAUSE_AT": pause_at} if pause_at else {}
    return subprocess.Popen(
        [sys.executable, script, f"hydra.run.dir={run_dir}", ONE_PROCESS, *overrides],
        cwd=PROJECT_ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **env},
    )


def wait_until(condition, timeout: float = 120, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def kill_when_paused(run_dir: Path, point: str, step: int | None, *overrides: str) -> None:
    """Run until a save pauses at POINT for STEP (None: the first time it passes
    POINT), then SIGKILL the process there."""
    out = Path(f"{run_dir}.out")
    seen = out.stat().st_size if out.exists() else 0  # earlier runs append there too
    pause = point if step is None else f"{point}@{step}"
    proc = start_train(run_dir, *overrides, pause_at=pause)
    try:
        wait_until(
            lambda: b"CKPT_TEST_PAUSED" in out.read_bytes()[seen:] or proc.poll() is not None,
            what=f"the pause at {point}@{step}",
        )
        assert proc.poll() is None, out.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs of ARGS (plus data.num_workers and extra overrides),
    each made once per module."""
    runs: dict[tuple, Path] = {}

    def _get(num_workers: int = 0, *extra: str) -> Path:
        key = (num_workers, *extra)
        if key not in runs:
            run_dir = tmp_path_factory.mktemp("reference") / "run"
            run_train(run_dir, *ARGS, f"data.num_workers={num_workers}", *extra)
            runs[key] = run_dir
        return runs[key]

    return _get


def copy_run(src: Path, dst: Path) -> Path:
    """The run dir as a crash would leave it: no summary, no final weights."""
    shutil.copytree(src, dst)
    (dst / "summary.json").unlink()
    (dst / "model.safetensors").unlink()
    return dst


# --- layout, manifest, pointers, pruning ------------------------------------------------


def test_layout_manifest_pointers_and_pruning(reference):
    run = reference(0)
    root = run / "checkpoints"
    summary = json.loads((run / "summary.json").read_text())
    best_step = summary["best"]["step"]
    # Saved at 7, 14, ..., 77, at new bests (10, 20, ...) and at 80; kept: the
    # keep_last=3 newest plus the best one. Nothing half-written remains.
    assert steps_in(run) == sorted({70, 77, 80, best_step})
    assert not list(root.glob("*.tmp")) and not list(root.glob(".*"))
    assert json.loads((root / "latest.json").read_text()) == {"step": 80, "path": "step_0000080"}
    best = json.loads((root / "best.json").read_text())
    assert best["step"] == best_step and best["monitor"] == "val/acc"
    assert best["value"] == summary["best"]["value"]

    ckpt = ckpt_dir(run, 77)  # mid-epoch: epoch 4 (index 3), batch 77 - 3 * 23 = 8
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    assert manifest["step"] == 77 and manifest["epoch"] == 3 and manifest["batch"] == 8
    assert manifest["world_size"] == 1 and manifest["seed"] == 42
    assert manifest["reasons"] == ["every_n_steps"]
    assert {"torch", "accelerate", "safetensors", "numpy", "python"} <= set(manifest["versions"])
    assert manifest["metrics"]["train/loss"] > 0
    assert set(manifest["files"]) == {p.name for p in ckpt.iterdir()} - {"MANIFEST.json"}
    assert set(manifest["files"]) == {
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_rank0.pt",
        "trainer_state.json",
        "config.json",
    }
    for name, entry in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        assert entry == {"xxh3_128": xxhash.xxh3_128(data).hexdigest(), "size": len(data)}
    assert manifest["hash"] == "xxh3_128"

    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert (state["step"], state["epoch"], state["batch"]) == (77, 3, 8)
    assert state["loss_guard"]["skipped_nan_steps"] == 0
    assert state["stateful"]["metrics"]["last"]["train/loss"] == manifest["metrics"]["train/loss"]
    assert json.loads((ckpt / "config.json").read_text()) == json.loads(
        (run / "config.json").read_text()
    )
    # Plain tensors and containers only: loads with weights_only=True.
    rng = torch.load(ckpt / "rng_rank0.pt", weights_only=True)
    assert rng["torch"].dtype == torch.uint8 and rng["python"]["state"].numel() == 625
    assert torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    # The final checkpoint holds the final weights.
    assert_same_weights(ckpt_dir(run, 80), run)


def test_every_n_epochs_saves_at_epoch_ends_and_resumes_at_the_next_epoch(tmp_path):
    run = tmp_path / "run"
    only_epochs = [
        "checkpoint.every_n_steps=null",
        "checkpoint.every_n_epochs=1",
        "checkpoint.save_best.enabled=false",
        "checkpoint.save_last=false",
        "tracker=none",
    ]
    run_train(run, "trainer.max_steps=50", *only_epochs)
    assert steps_in(run) == [23, 46]
    manifest = json.loads((ckpt_dir(run, 46) / "MANIFEST.json").read_text())
    assert (manifest["epoch"], manifest["batch"], manifest["reasons"]) == (
        1,
        23,
        ["every_n_epochs"],
    )
    assert not (run / "checkpoints" / "best.json").exists()
    # A longer run (trainer.max_steps may change) continues with the third epoch.
    longer = run_train(run, "trainer.max_steps=60", *only_epochs)
    assert f"resumed from {ckpt_dir(run, 46)}: step 46, epoch 2, batch 23 of 23" in longer.output
    assert longer.summary["step"] == 60 and longer.summary["epoch"] == 3


def test_config_checks_name_key_value_and_allowed(compose_cfg, tmp_path):
    cases = {
        "checkpoint.keep_last=1": "checkpoint.keep_last=1 is not allowed: expected an integer >= 2",
        "checkpoint.every_n_steps=0": "checkpoint.every_n_steps=0 is not allowed",
        "checkpoint.resume=/no/such/dir": "checkpoint.resume='/no/such/dir' is not allowed: "
        "expected auto, never, or an existing directory",
        "checkpoint.save_best.mode=up": "checkpoint.save_best.mode='up' is not allowed",
        "trainer.on_nan=ignore": "trainer.on_nan='ignore' is not allowed: expected stop or skip",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match="Invalid configuration") as err:
            check_config(resolve_config(compose_cfg(override)))
        assert message in str(err.value)
    check_config(resolve_config(compose_cfg(f"checkpoint.resume={tmp_path}")))
    check_config(resolve_config(compose_cfg("checkpoint=none")))


# --- resume -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_workers", "killed_at", "extra"),
    [
        (0, 12, ()),
        pytest.param(2, 52, (), marks=pytest.mark.slow),
        pytest.param(0, 23, (), marks=pytest.mark.slow),  # at the end of epoch 1
        # 3 micro-batches per step: epoch 1 ends on a partial accumulation.
        pytest.param(0, 10, ("trainer.grad_accum_steps=3",), marks=pytest.mark.slow),
    ],
)
def test_interrupted_run_resumes_bit_exactly(reference, tmp_path, num_workers, killed_at, extra):
    """SIGKILL right after a checkpoint (mid-epoch, or at an epoch's end),
    restart the same command: the final weights equal the uninterrupted run's,
    tensor for tensor."""
    args = [*ARGS, f"data.num_workers={num_workers}", *extra]
    run = tmp_path / "run"
    # Save every step in the interrupted run (checkpoint.* may change on resume).
    kill_when_paused(run, "before_pointers", killed_at, *args, "checkpoint.every_n_steps=1")
    state = json.loads((ckpt_dir(run, killed_at) / "trainer_state.json").read_text())
    assert 0 < state["batch"] < BATCHES_PER_EPOCH or killed_at == BATCHES_PER_EPOCH
    resumed = run_train(run, *args)
    assert f"resumed from {ckpt_dir(run, killed_at)}" in resumed.output
    assert resumed.summary["resumed_from"] == str(ckpt_dir(run, killed_at))
    ref = reference(num_workers, *extra)
    assert resumed.summary["step"] == json.loads((ref / "summary.json").read_text())["step"]
    assert_same_weights(run, ref)
    assert resumed.summary["best"] == json.loads((ref / "summary.json").read_text())["best"]


@pytest.mark.parametrize(
    ("signum", "code"),
    [(signal.SIGTERM, 143), pytest.param(signal.SIGUSR1, 138, marks=pytest.mark.slow)],
)
def test_signal_saves_exits_and_resumes(reference, tmp_path, signum, code):
    run = tmp_path / "run"
    proc = start_train(run, *ARGS)
    wait_until(lambda: ckpt_dir(run, 7).is_dir() or proc.poll() is not None, what="step 7")
    proc.send_signal(signum)
    assert proc.wait(timeout=120) == code
    output = Path(f"{run}.out").read_text()
    assert f"{signal.Signals(signum).name} received: stopped at a step boundary" in output
    # The step at which the signal was seen; saved then, or already saved at it
    # when the signal came during that step's own save.
    stopped = max(steps_in(run))
    assert 7 <= stopped < 80, output[-2000:]
    assert f"checkpoint saved at {ckpt_dir(run, stopped)}" in output
    manifest = json.loads((ckpt_dir(run, stopped) / "MANIFEST.json").read_text())
    assert "signal" in manifest["reasons"] or stopped == 7
    assert not (run / "summary.json").exists()  # not finished
    resumed = run_train(run, *ARGS)
    assert resumed.summary["resumed_from"] == str(ckpt_dir(run, stopped))
    assert_same_weights(run, reference(0))


def _half_a_file(path: Path, source: Path) -> None:
    path.write_bytes(source.read_bytes()[: source.stat().st_size // 2])


def _one_byte_changed(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # in a tensor: the header still parses, the checksum does not match
    path.write_bytes(bytes(data))


def test_an_end_cut_short_is_completed_by_the_rerun(reference, tmp_path):
    """The end writes model.safetensors, then summary.json LAST, recording the weights'
    size and checksum; finished means both, verified (issue 38). A SIGKILL while the
    final weights are written, and each state a kill of the end leaves on disk (one:
    an older engine's order, summary first), are completed by the same command from
    the last checkpoint (step 80: nothing left to train): exit 0, the weights
    bit-equal to the uninterrupted run's, the same metrics and best, no .tmp left."""
    args = [*ARGS, "data.num_workers=0", "preflight=off"]  # preflight may change on a resume
    ref = reference(0)
    expected = json.loads((ref / "summary.json").read_text())
    weights_file = (ref / fmt.MODEL).read_bytes()
    run = copy_run(ref, tmp_path / "run")  # killed after its last checkpoint
    kill_when_paused(run, "final_weights", None, *args)  # a real end, killed in it
    assert (run / ".model.safetensors.tmp").is_file()
    assert not (run / "model.safetensors").exists() and not (run / "summary.json").exists()
    cuts = [  # (what, how it is left, whether a summary says finished: the log says why not)
        ("killed writing the final weights", lambda: None, False),
        (
            "summary first (the old order), killed writing the weights",
            lambda: (
                (run / "model.safetensors").unlink(),
                _half_a_file(run / ".model.safetensors.tmp", ref / "model.safetensors"),
            ),
            True,
        ),
        (
            "killed writing the summary",
            lambda: (
                _half_a_file(run / ".summary.json.tmp", ref / "summary.json"),
                (run / "summary.json").unlink(),
            ),
            False,
        ),
        ("other weights than it records", lambda: _one_byte_changed(run / fmt.MODEL), True),
    ]
    for what, cut, summary_there in cuts:
        cut()
        rerun = run_train(run, *args)  # exit 0, or the test fails here
        assert "resumed from " + str(ckpt_dir(run, 80)) in rerun.output, what
        assert ("its end was cut short" in rerun.output) == summary_there, what
        assert (run / fmt.MODEL).read_bytes() == weights_file, what
        summary = rerun.summary
        for key in ("step", "epoch", "metrics", "best", "final_weights"):
            assert summary[key] == expected[key], (what, key)
        assert summary["rates"]["training_only"]["samples_per_sec"] > 0, what
        assert not list(run.glob("*.tmp")), what
    assert_same_weights(run, ref)


def test_resume_from_another_runs_checkpoint_and_never(reference, tmp_path):
    ref = reference(0)
    # A checkpoint folder of another run: continue from it in a new run dir.
    from_70 = [*ARGS, f"checkpoint.resume={ckpt_dir(ref, 70)}"]
    other = run_train(tmp_path / "other", *from_70)
    assert other.summary["resumed_from"] == str(ckpt_dir(ref, 70))
    assert_same_weights(other.run_dir, ref)
    # The same command again: finished, so it is reported and nothing changes.
    again = run_train(other.run_dir, *from_70)
    assert "is a finished run (step 80" in again.output
    assert again.summary["resumed_from"] == str(ckpt_dir(ref, 70))
    # Longer: this run continues from its own checkpoints, not the path that started it.
    longer = run_train(other.run_dir, *from_70, "trainer.max_steps=85")
    assert longer.summary["resumed_from"] == str(ckpt_dir(other.run_dir, 80))
    assert longer.summary["step"] == 85 and "continuing this run from them" in longer.output
    # never, in a run dir that has checkpoints: refused rather than mixing two runs,
    # before any work (exit 2). (In a new run dir it is a fresh start, as every
    # other test's first run.)
    again = run_train(other.run_dir, *ARGS, "checkpoint.resume=never", check=False)
    assert again.proc.returncode == 2
    assert "checkpoint.resume=never, but" in again.output and "Traceback" not in again.output


# --- integrity and safety -------------------------------------------------------------------


def test_corrupted_checkpoints_are_skipped_with_a_warning(reference, tmp_path):
    run = copy_run(reference(0), tmp_path / "run")
    truncated = ckpt_dir(run, 80) / "optimizer.pt"
    truncated.write_bytes(truncated.read_bytes()[:100])
    flipped = ckpt_dir(run, 77) / "model.safetensors"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    assert "truncated" in verify_checkpoint(truncated.parent)
    assert "xxh3_128 does not match" in verify_checkpoint(flipped.parent)
    assert verify_checkpoint(ckpt_dir(run, 70)) is None

    resumed = run_train(run, *ARGS)
    assert f"{truncated}: 100 bytes" in resumed.output
    assert f"{flipped}: xxh3_128 does not match" in resumed.output
    assert resumed.summary["resumed_from"] == str(ckpt_dir(run, 70))
    assert_same_weights(run, reference(0))
    # The bad ones were set aside (not deleted), then 77 and 80 saved again, valid.
    assert len(list((run / "checkpoints").glob("step_0000080.superseded-*"))) == 1
    assert verify_checkpoint(ckpt_dir(run, 80)) is None


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_malicious_pickle_is_refused_and_never_runs(reference, tmp_path):
    marker = tmp_path / "PAYLOAD_RAN"
    run = copy_run(reference(0), tmp_path / "run")
    ckpt = ckpt_dir(run, 80)
    evil = pickle.dumps({"state": {}, "param_groups": [], "x": _Payload(marker)})
    torch.save({"state": {}, "x": _Payload(marker)}, ckpt / "optimizer.pt")
    # An attacker who can write files can also fix the manifest: hashes pass.
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    data = (ckpt / "optimizer.pt").read_bytes()
    manifest["files"]["optimizer.pt"] = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
    }
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))
    assert "optimizer.pt: refused" in verify_checkpoint(ckpt)  # judged by what it holds

    with pytest.raises(CheckpointError, match="refused"):
        load_tensors_safely(data, "optimizer.pt")
    with pytest.raises(CheckpointError, match="refused"):
        load_tensors_safely(evil, "evil.pkl")
    resumed = run_train(run, *ARGS)
    assert f"{ckpt / 'optimizer.pt'}: refused" in resumed.output
    assert resumed.summary["resumed_from"] == str(ckpt_dir(run, 77))
    assert_same_weights(run, reference(0))
    assert not marker.exists()


def test_incompatible_config_is_refused_listing_the_keys(reference, tmp_path):
    changed = ["model.width=64", "optimizer=sgd", "seed=1"]
    # In the run's own directory the run dir's claim refuses first (nothing written).
    run = copy_run(reference(0), tmp_path / "run")
    refused = run_train(run, *ARGS, *changed, check=False)
    assert refused.proc.returncode == 2 and "Traceback" not in refused.output
    assert f"{run} holds another run (its config differs in " in refused.output
    assert steps_in(run) == steps_in(reference(0))  # nothing set aside or deleted
    # Resuming another run's checkpoint from a new directory: the checkpoint refuses.
    ckpt = ckpt_dir(reference(0), 70)
    other = run_train(tmp_path / "new", *ARGS, *changed, f"checkpoint.resume={ckpt}", check=False)
    assert other.proc.returncode == 1 and "Traceback" not in other.output
    assert "the config differs in keys that change the model, data or optimization" in (
        other.output
    )
    for key in ("model.width", "optimizer._target_", "optimizer.lr", "seed"):
        assert f"  {key}: " in other.output
    assert "trainer.max_steps" not in other.output.split("Allowed to change")[0]


# --- bad conditions ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "failed_step", "left"),
    [
        # One checkpoint (~0.3 MB) fits, the second does not.
        ("size=480k", "No space left on device", 14, ["latest.json", "step_0000007"]),
        ("ro", "Read-only file system", 7, []),
    ],
    ids=["full", "read-only"],
)
def test_disk_errors_fail_clearly_and_keep_earlier_checkpoints(
    tmp_path, reference, options, error, failed_step, left
):
    """A full (or read-only) disk: one clear message (a full one names the file system,
    what it has free and what a checkpoint takes), nothing half-written left; once
    there is room again, the same command resumes and ends bit-exact."""
    run = tmp_path / "run"
    root = run / "checkpoints"
    root.mkdir(parents=True)
    mount_tmpfs(root, options)
    try:
        failed = run_train(run, *ARGS, "checkpoint.save_best.enabled=false", check=False)
        assert failed.proc.returncode == 1, failed.output[-2000:]
        assert f"could not write checkpoint step_{failed_step:07d} in {root}: {error}" in (
            failed.output
        )
        assert "Earlier checkpoints are intact" in failed.output
        assert "Traceback" not in failed.output
        assert sorted(p.name for p in root.iterdir()) == left  # no *.tmp left behind
        assert all(verify_checkpoint(root / name) is None for name in left if "step" in name)
        if "size" in options:
            assert f"the disk is full: the file system mounted at {root} (tmpfs) has " in (
                failed.output
            )
            assert "MiB free of 0.5 MiB; one checkpoint of this run takes about" in failed.output
            subprocess.run(["mount", "-o", "remount,size=8m", str(root)], check=True)
            resumed = run_train(run, *ARGS, "checkpoint.save_best.enabled=false")
            assert "resuming from" in resumed.output or resumed.summary["resumed_from"]
            assert fingerprints(run) == fingerprints(reference(0))
    finally:
        subprocess.run(["umount", str(root)], check=True)


def test_an_end_the_disk_refuses_is_said_and_the_rerun_completes_it(tmp_path, reference):
    """The run dir's disk fills up after the final weights (paused at moments' "trackers"):
    exit 1 saying what could not be written and why, train.log's lines on stderr instead
    (a failure that cannot write its own report still says it), no summary.json, no
    restart; once there is room the same command completes the end, bit-exact."""
    run = tmp_path / "run"
    run.mkdir()
    mount_tmpfs(run, "size=8m")
    try:
        args = [*ARGS, "data.num_workers=0"]
        out = Path(f"{run}.out")
        proc = start_train(run, *args, pause_at="trackers+8")
        wait_until(lambda: b"CKPT_TEST_PAUSED" in out.read_bytes() or proc.poll() is not None)
        fill(run / "filler")
        assert shutil.disk_usage(run).free == 0
        assert proc.wait(timeout=120) == 1, out.read_text()[-3000:]
        said = out.read_text()
        assert f"could not write the end of the run in {run} (summary.json)" in said
        assert f"the disk is full: the file system mounted at {run} (tmpfs)" in said
        assert "Traceback" not in said and not (run / "summary.json").exists()
        assert not list(run.glob(".*.tmp"))  # the summary's half: removed
        (run / "filler").unlink()
        rerun = run_train(run, *args)
        assert f"resumed from {ckpt_dir(run, 80)}" in rerun.output
        assert_same_weights(run, reference(0))
        assert not list(run.glob(".*.tmp"))
    finally:
        subprocess.run(["umount", str(run)], check=True)


def fill(path: Path) -> None:
    """Take every byte left on ``path``'s file system."""
    with open(path, "wb", buffering=0) as filler, contextlib.suppress(OSError):
        while True:
            filler.write(bytes(2**16))


def test_a_log_that_cannot_be_written_goes_to_stderr(capsys):
    """train.log's handler on a disk that refuses it (/dev/full: ENOSPC on every write):
    one line saying so, then each record on stderr, never logging's own traceback."""
    import logging

    from training_engine.logs import RunFileHandler

    handler = RunFileHandler("/dev/full")
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    record = logging.LogRecord("train", logging.ERROR, __file__, 1, "could not save", None, None)
    handler.handle(record)
    handler.handle(record)
    err = capsys.readouterr().err
    assert err.count("/dev/full cannot be written (No space left on device): on stderr") == 1
    assert err.count("ERROR could not save") == 2 and "Traceback" not in err
    handler.close()


def mount_tmpfs(path: Path, options: str) -> None:
    """A small tmpfs at ``path`` (root and mount: CI runs as root)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)])
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")


def test_nan_loss_stop_and_skip(tmp_path):
    blow_up = [
        "trainer.max_steps=20",
        "optimizer=sgd",
        "optimizer.lr=1e30",
        "trainer.grad_clip_norm=null",
        "scheduler=constant",
        "checkpoint.every_n_steps=1",
        "tracker=none",
    ]
    stop = run_train(tmp_path / "stop", *blow_up, check=False)
    assert stop.proc.returncode == 3 and "Traceback" not in stop.output
    assert "the training loss was not finite (NaN/inf) at step 2" in stop.output
    assert steps_in(stop.run_dir) == [1]  # the last good one; nothing after step 2
    good = weights(ckpt_dir(stop.run_dir, 1))
    assert all(torch.isfinite(t).all() for t in good.values())
    assert not (stop.run_dir / "model.safetensors").exists()

    no_limit = ("trainer.on_nan=skip", "trainer.skip_budget=null")
    skip = run_train(tmp_path / "skip", *blow_up, *no_limit)
    assert skip.summary["skipped_nan_steps"] == 19  # every step after the first
    assert "update dropped (trainer.on_nan=skip)" in skip.output
    assert "| 19 updates dropped (on_nan=skip)" in skip.output  # the final line says so
    state = json.loads((ckpt_dir(skip.run_dir, 20) / "trainer_state.json").read_text())
    assert state["loss_guard"]["skipped_nan_steps"] == 19
    final = weights(skip.run_dir)
    assert all(torch.equal(final[k], good[k]) for k in good)  # no update after step 1

    # The budget (trainer.skip_budget): the 6th update dropped in a row stops the run
    over = ("trainer.on_nan=skip", "trainer.skip_budget=5")
    budget = run_train(tmp_path / "budget", *blow_up, *over, check=False)
    assert budget.proc.returncode == 3 and "Traceback" not in budget.output
    assert "not finite (NaN/inf) at steps 2..7: 6 updates in a row were dropped" in budget.output
    assert "enable trainer.grad_clip_norm" in budget.output  # it is off here
    assert steps_in(budget.run_dir)[-1] == 6  # none from the step that stopped it


def test_tied_weights_round_trip(tmp_path):
    """safetensors refuses shared tensors; tied weights must still save and load."""
    from accelerate import Accelerator
    from omegaconf import OmegaConf

    from training_engine.checkpoint import CheckpointManager
    from training_engine.state import TrainState

    def tied_model() -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight
        return model

    cfg = OmegaConf.create(
        {"seed": 0, "checkpoint": {"enabled": True, "keep_last": 2, "save_on_signal": False}}
    )
    accelerator = Accelerator(cpu=True)

    def manager(model: torch.nn.Module, run_dir: Path) -> CheckpointManager:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        state = TrainState(model, optimizer, scheduler, train_loader=[None], val_loader=[])
        return CheckpointManager(
            checkpoint=cfg.checkpoint,
            config=OmegaConf.to_container(cfg),
            run_dir=run_dir,
            accelerator=accelerator,
            state=state,
        )

    saved_model = tied_model()
    saved = manager(saved_model, tmp_path / "a").save(3, 0, 1, ["test"])
    assert verify_checkpoint(saved) is None
    loaded_model = tied_model()
    assert manager(loaded_model, tmp_path / "b").load(saved).step == 3
    assert loaded_model[1].weight is loaded_model[0].weight  # still tied
    assert torch.equal(loaded_model[0].weight, saved_model[0].weight)


# --- command line ------------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "training_engine.checkpoint", *args],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
    )


def test_cli_list_verify_export(reference, tmp_path, capsys):
    ref = reference(0)
    listed = cli("list", str(ref))  # once as a real `python -m`, then in-process
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:4] == ["checkpoint", "step", "epoch", "size"]
    row = next(line for line in lines if line.startswith("step_0000077"))
    assert row.split()[1:3] == ["77", "4"] and "valid" in row and "train/loss=" in row

    def run_cli(*args: str) -> tuple[int, str]:
        code = checkpoint_cli(list(args))
        return code, capsys.readouterr().out

    code, out = run_cli("verify", str(ref / "checkpoints"))
    assert code == 0 and f"{len(steps_in(ref))} valid, 0 invalid" in out

    run = copy_run(ref, tmp_path / "run")
    (ckpt_dir(run, 77) / "scheduler.pt").write_bytes(b"garbage")
    code, out = run_cli("verify", str(run))
    assert code == 1 and "1 invalid" in out and "scheduler.pt: 7 bytes" in out
    assert "INVALID" in run_cli("list", str(run))[1]

    exported = tmp_path / "export" / "weights.safetensors"
    code, out = run_cli("export", str(run), "-o", str(exported))
    assert code == 0 and f"{ckpt_dir(run, 80) / 'model.safetensors'} -> {exported}" in out
    assert_same_weights(exported, ref)


# --- fault injection -----------------------------------------------------------------------------


# (moment, step) per kill; each trial is one run dir killed three times, then
# run to the end. A random kill comes within 50 ms of a new checkpoint;
# "pruning" pauses at the first deletion of an old checkpoint. Two halves of 4
# trials (12 kills each): CI runs the first, which kills at every moment at
# least twice (about 200 s on 2 cores); `pytest -m slow` runs both (24 kills).
SIGKILL_TRIALS = {
    "every_moment_twice": [
        [("between_files", 7), ("before_rename", 21), ("random", None)],
        [("before_rename", 14), ("between_files", 35), ("before_pointers", 49)],
        [("pruning", None), ("between_files", 77), ("random", None)],
        [("between_files", 14), ("before_pointers", 28), ("pruning", None)],
    ],
    "more_steps": [
        [("before_pointers", 7), ("between_files", 63), ("random", None)],
        [("random", None), ("before_rename", 56), ("before_pointers", 70)],
        [("between_files", 28), ("before_pointers", 42), ("before_rename", 70)],
        [("before_rename", 7), ("random", None), ("before_pointers", 77)],
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "half", [pytest.param("every_moment_twice", marks=pytest.mark.ci), "more_steps"]
)
def test_sigkill_at_many_moments_always_resumes_to_the_same_weights(reference, tmp_path, half):
    """Up to 12 SIGKILLs per half (about 10 at pause points, 2 at random moments):
    during saves (between files, before the rename, before the pointers, while
    pruning) and at random times. After each, every committed checkpoint must be
    valid; each run is then finished by restarting the same command and must end
    with the uninterrupted run's weights."""
    rng = random.Random(0)
    ref = reference(0)
    kills = 0
    trials = SIGKILL_TRIALS[half]
    for trial, moments in enumerate(trials):
        run = tmp_path / f"trial{trial}"
        for moment, step in moments:
            before = steps_in(run)
            if moment == "random":
                proc = start_train(run, *ARGS)
                wait_until(
                    lambda r=run, b=before, p=proc: (
                        set(steps_in(r)) - set(b) or p.poll() is not None
                    ),
                    what="a new checkpoint",
                )
                time.sleep(rng.uniform(0, 0.05))
                if proc.poll() is not None:
                    continue  # finished first: not a kill
                proc.kill()
                proc.wait()
            elif step is not None and step <= max(before, default=0):
                continue  # a random kill came later than this step
            else:
                kill_when_paused(run, moment, step, *ARGS)
            kills += 1
            root = run / "checkpoints"
            committed = [p for p in committed_checkpoints(root)]
            assert all(verify_checkpoint(p) is None for p in committed), moment
            if moment in ("between_files", "before_rename"):
                assert (root / f"step_{step:07d}.tmp").is_dir()
                assert ckpt_dir(run, step) not in committed
            if moment == "pruning":  # renamed away first, so never a half checkpoint
                assert list(root.glob("step_*.pruned.tmp"))
        finished = (run / "summary.json").exists()  # a random kill came after the end
        done = run_train(run, *ARGS)
        if steps_in(run) and not finished and done.summary["resumed_from"] is not None:
            assert "resumed from" in done.output
        assert not list((run / "checkpoints").glob("*.tmp"))
        assert_same_weights(run, ref)
    print(f"{kills} SIGKILLs in {len(trials)} runs: every resume matched the reference")
    assert kills >= 10  # a random kill may come after a later planned step, or not at all
