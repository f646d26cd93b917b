"""Preflight (preflight/): real runs of train.py with the checks on, on a real
small filesystem, with a model whose state does not restore, and under DDP;
MFU's FLOPs and peaks (throughput.py)."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from digit_trainer.models.digits import MLP, SmallCNN
from safetensors.torch import load_file
from torch.utils.flop_counter import FlopCounterMode

from training_engine.throughput import Throughput, peak_flops, peak_for_name

from .conftest import FAST, ONE_PROCESS, PATHS, PROJECT_ROOT

# FAST turns preflight off (it costs every test run time); these turn it on.
PREFLIGHT = [*FAST, "preflight=default"]
ONLY = [*PREFLIGHT, "preflight.only=true"]
CHECKS = ["devices", "memory", "checkpoint", "disk", "speed", "distributed", "trackers"]
ESTIMATES = {"steps_per_sec", "eta_s", "checkpoint_bytes", "disk_free_bytes", "peak_memory_bytes"}
# what eta_s sums, from the run's own plan
ESTIMATES |= {"steps_left", "step_s", "evaluations", "eval_s", "checkpoints", "checkpoint_s"}
ESTIMATES |= {"parameters"}  # total, trainable, what frozen ones save (test_peft.py: some)
# The tests' own modules (engine_tests.faults) must be importable in spawned workers too.
ENV = {**os.environ, **PATHS}


def report(run_dir: Path) -> dict:
    return json.loads((run_dir / "preflight.json").read_text())


def statuses(run_dir: Path) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report(run_dir)["checks"]}


def assert_nothing_trained_or_saved(run_dir: Path) -> None:
    assert not (run_dir / ".preflight").exists()  # the scratch checkpoints are gone
    assert not (run_dir / "checkpoints").exists()
    assert not (run_dir / "model.safetensors").exists()
    assert not (run_dir / "summary.json").exists()


def checkpoint_sizes(run_dir: Path) -> list[int]:
    return [
        sum(f.stat().st_size for f in d.iterdir())
        for d in sorted((run_dir / "checkpoints").glob("step_*"))
    ]


def test_preflight_only_passes_on_cpu_and_writes_every_field(train_run):
    run = train_run(*ONLY)
    data = report(run.run_dir)
    assert set(data) == {"checks", "estimates"}
    assert [c["name"] for c in data["checks"]] == CHECKS
    assert all(set(c) == {"name", "status", "detail"} and c["detail"] for c in data["checks"])
    found = statuses(run.run_dir)
    # speed may warn on a busy machine (the loader's share of a step); nothing fails.
    assert {k: v for k, v in found.items() if k != "speed"} == dict.fromkeys(
        set(CHECKS) - {"speed"}, "pass"
    )
    assert found["speed"] in ("pass", "warn")
    est = data["estimates"]
    assert set(est) == ESTIMATES
    counts = est.pop("parameters")  # every parameter trains: nothing saved
    assert counts["trainable"] == counts["total"] > 0 and counts["saved_gradient_bytes"] == 0
    assert all(isinstance(v, int | float) and v > 0 for v in est.values()), est
    # 30 configured steps at the measured speed: the ETA covers at least the steps.
    assert est["eta_s"] >= 30 / est["steps_per_sec"]
    assert est["disk_free_bytes"] > est["checkpoint_bytes"]
    # The table is in the log, with every check; nothing was trained or kept.
    log = (run.run_dir / "train.log").read_text()
    assert all(f"│ {name}" in log for name in CHECKS)
    assert "MFU skipped: no peak-FLOPs figure for CPU devices" in log
    assert "step 5/30" not in log  # nothing trained
    assert_nothing_trained_or_saved(run.run_dir)


def test_preflight_leaves_training_bit_identical_and_sizes_checkpoints(train_run):
    """The timed steps are undone by the round trip: same weights as without
    preflight. Its checkpoint size is the size of the run's real checkpoints."""
    on = train_run(*PREFLIGHT, "checkpoint.every_n_steps=10")
    off = train_run(*FAST, "checkpoint.every_n_steps=10")
    a, b = load_file(on.run_dir / "model.safetensors"), load_file(off.run_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    estimate = report(on.run_dir)["estimates"]["checkpoint_bytes"]
    real = checkpoint_sizes(on.run_dir)
    assert real and all(abs(estimate - size) / size < 0.10 for size in real), (estimate, real)
    # Progress lines show samples/s beside steps/s.
    assert "samples/s | " in on.output and "steps/s | eta" in on.output
    # The ETA is the run's own plan (loaders.RunPlan, the checkpoint policy), not a guess:
    # the steps, evaluations and checkpoints it sums are the ones the run then made.
    terms = report(on.run_dir)["estimates"]
    evaluated = {int(r["step"]) for r in csv.DictReader((on.run_dir / "metrics.csv").open())
                 if r["name"] == "val/loss"}  # fmt: skip
    assert terms["steps_left"] == on.summary["step"] == 30
    assert terms["evaluations"] == len(evaluated) == 3
    assert terms["checkpoints"] == len(real) == 3  # every 10 steps, a best, the last: 10/20/30
    total = (
        terms["steps_left"] * terms["step_s"]
        + terms["evaluations"] * terms["eval_s"]
        + terms["checkpoints"] * terms["checkpoint_s"]
    )
    assert terms["eta_s"] == pytest.approx(total)


def test_a_state_that_does_not_restore_fails_the_round_trip(train_run):
    run = train_run(*ONLY, "model._target_=engine_tests.faults.ForgetsWeightsOnLoad", check=False)
    assert run.proc.returncode == 1, run.output[-3000:]
    found = statuses(run.run_dir)
    assert found["checkpoint"] == "fail"
    assert found["devices"] == found["disk"] == "pass"
    detail = next(c["detail"] for c in report(run.run_dir)["checks"] if c["name"] == "checkpoint")
    assert "differ after save -> load: model.net.1.weight" in detail
    assert "preflight failed, nothing trained" in run.output
    assert_nothing_trained_or_saved(run.run_dir)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs: room for one checkpoint of the example (about 0.33 MiB),
    not for the 5 that keep_last=3 + best + one in flight need."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_disk_too_small_for_the_kept_checkpoints_fails_before_training(small_tmpfs):
    run_dir = small_tmpfs / "run"
    proc = subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={run_dir}", ONE_PROCESS, *PREFLIGHT],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "disk: not enough disk space" in out
    assert "need 1.6 MiB" in out and "keep_last 3 + best + 1 in flight" in out
    assert statuses(run_dir)["disk"] == "fail"
    assert_nothing_trained_or_saved(run_dir)


# --- under DDP: every rank takes part ------------------------------------------------


def run_two(run_dir: Path, mode: str, *overrides: str, cores: set[int] | None = None):
    """``parallel=MODE`` with two processes (the default of ddp/fsdp on a CPU)."""
    return subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={run_dir}", f"parallel={mode}", *overrides],
        cwd=PROJECT_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        # Restrict this process (and the workers it spawns) to these CPU cores.
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
    )


@pytest.mark.multiprocess
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores")
def test_under_fsdp_every_rank_checks_and_training_is_unchanged(tmp_path):
    """Sharded (DTensor) state round trip and an all-reduce over both ranks; the
    weights equal DDP's without preflight (FSDP equals DDP bit for bit, see
    test_parallel.py)."""
    same = ["model.dropout=0.0"]
    wrap = "parallel.auto_wrap_min_params=1000"  # several FSDP units, as in test_parallel.py
    fsdp = run_two(tmp_path / "fsdp", "fsdp", *PREFLIGHT, *same, wrap)
    assert fsdp.returncode == 0, (fsdp.stdout + fsdp.stderr)[-3000:]
    ddp = run_two(tmp_path / "ddp", "ddp", *FAST, *same)
    assert ddp.returncode == 0, (ddp.stdout + ddp.stderr)[-3000:]
    checks = {c["name"]: c for c in report(tmp_path / "fsdp")["checks"]}
    assert all(c["status"] in ("pass", "warn") for c in checks.values()), checks
    assert "all-reduce over 2 ranks (gloo) correct" in checks["distributed"]["detail"]
    assert checks["devices"]["detail"].startswith("world size 2: 2 process(es)")
    a = load_file(tmp_path / "fsdp" / "model.safetensors")
    b = load_file(tmp_path / "ddp" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.multiprocess
def test_a_world_size_the_cores_cannot_give_fails(tmp_path):
    """Two processes pinned to one CPU core: more ranks than devices."""
    one_core = {min(os.sched_getaffinity(0))}
    proc = run_two(tmp_path / "run", "ddp", *ONLY, cores=one_core)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "2 processes share 1 CPU core(s): the world size needs a core per process" in out
    assert statuses(tmp_path / "run")["devices"] == "fail"
    assert_nothing_trained_or_saved(tmp_path / "run")


# --- MFU -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    [MLP(64, 10, width=128, depth=2), SmallCNN(1, 10, [32, 64], image_size=8)],
    ids=lambda m: type(m).__name__,
)
def test_declared_flops_are_three_times_torchs_forward_count(model):
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.zeros(4, 1, 8, 8))
    assert model.flops_per_sample() == 3 * counter.get_total_flops() / 4


def test_peak_flops_table_and_world_size():
    assert peak_for_name("NVIDIA H200", "bf16")[0] == 989.4e12
    assert peak_for_name("NVIDIA H100 PCIe", "bf16")[0] == 756.5e12
    assert peak_for_name("NVIDIA A100-SXM4-80GB", "fp32")[0] == 19.5e12
    assert peak_for_name("NVIDIA L40S", "tf32")[0] == 183.1e12  # not the L4's
    assert peak_for_name("NVIDIA L4", "bf16")[0] == 121e12
    assert peak_for_name("Tesla V100-SXM2-32GB", "bf16")[0] is None  # no bf16
    assert peak_for_name("NVIDIA A10G", "bf16") == (
        None,
        "no peak-FLOPs figure for NVIDIA A10G: add it to PEAK_TFLOPS in throughput.py",
    )
    assert peak_flops(torch.device("cpu"), "no")[0] is None
    mfu = Throughput(MLP(64, 10, width=128, depth=2), torch.device("cpu"), 2, "no")
    assert "perf/mfu" not in mfu.metrics(1.0, samples=10**6)  # no peak for a CPU: no perf/mfu
    mfu.peak = 1e12  # as for a device in the table: MFU divides by every device's peak
    rates = mfu.metrics(1.0, samples=10**6)  # 1 step/s of 1e6 samples on each of 2 processes
    assert rates["perf/samples_per_sec"] == 2e6
    assert rates["perf/mfu"] == pytest.approx(mfu.flops_per_sample * 2e6 / 2e12)


def test_the_disk_check_gives_disk_advice_for_disk_errors_only(tmp_path):
    """A checkpoint that cannot be written at all fails the disk check; its advice
    follows the cause save.write_error named (a full disk, or the state itself)."""
    from training_engine.preflight.checks import Check, check_disk
    from training_engine.preflight.probe import RoundTrip, Timing

    failed = Check("checkpoint", "fail", "")
    causes = {
        "no space left on device (x). Earlier checkpoints are intact; free disk space": True,
        "Some tensors share memory. Earlier checkpoints are intact; this is not a disk "
        "problem: the state itself could not be written in this format": False,
    }
    for error, disk in causes.items():
        check = check_disk(
            None, tmp_path, 2**30, RoundTrip(failed, Timing(), save_error=error), None
        )
        assert check.status == "fail" and error in check.detail
        assert ("free disk space" in check.fix) is disk, check.fix
