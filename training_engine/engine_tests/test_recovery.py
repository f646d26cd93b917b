"""In-job recovery and hang detection (docs/recovery.md), with real processes:
2-process DDP on gloo, a worker killed with SIGKILL or stopped with SIGSTOP
between checkpoints; the same command ends with the weights of an uninterrupted
run, and summary.json records what the recovery cost."""

import collections
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import ENV, ONE_PROCESS, PROJECT_ROOT, TRAIN_WITH_FAULTS, wait_for

pytestmark = pytest.mark.multiprocess

TRAIN = str(PROJECT_ROOT / "train.py")
# 60 steps of ~50 ms, a checkpoint every 20: a fault after step 20 is between two
ARGS = [
    "parallel=ddp",
    "model._target_=engine_tests.faults.Slow",
    "trainer.max_steps=60",
    "trainer.log_every_n_steps=5",
    "trainer.eval_every_n_steps=10",
    "checkpoint.every_n_steps=20",
    "checkpoint.save_best.enabled=false",
    "tracker=csv",
    "preflight=off",
    "parallel.max_restarts=2",
]
# Small budgets for the SIGSTOP case (the defaults: minutes): a step may take
# 5 s (measured steps here: ~70 ms, so 10 x p95 stays below the floor)
SMALL_BUDGETS = ["watchdog.step_floor_s=5", "watchdog.poll_s=0.5"]
STEP_BUDGET_S = 5


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, TRAIN, ONE_PROCESS, *ARGS, f"hydra.run.dir={run_dir}", *overrides]
    log = open(run_dir.parent / f"{run_dir.name}.out", "w")  # noqa: SIM115 (the child's)
    return subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)


def finished(proc: subprocess.Popen, run_dir: Path, timeout: float = 300) -> str:
    code = proc.wait(timeout=timeout)
    out = (run_dir.parent / f"{run_dir.name}.out").read_text(errors="replace")
    assert code == 0, out[-5000:]
    return out


def alive(pid: int) -> bool:
    """Running (a zombie, waiting for its reaper, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def workers(launcher: subprocess.Popen) -> list[int]:
    """The launcher's spawned workers, in rank order (spawned in that order)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if parent == launcher.pid and b"spawn_main" in cmdline:
            found.append(int(proc.name))
    return sorted(found)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The uninterrupted run's final weights (one run for every test here)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    finished(start(run_dir), run_dir)
    return load_file(run_dir / "model.safetensors")


def fault_after_first_checkpoint(tmp_path: Path, sig: int, *overrides: str) -> tuple:
    """Start the run, send ``sig`` to rank 1 a few steps after the checkpoint of
    step 20; (launcher, run dir, when the signal was sent)."""
    run_dir = tmp_path / "run"
    launcher = start(run_dir, *overrides)
    wait_for(run_dir / "checkpoints" / "step_0000020", timeout=240)
    time.sleep(0.5)  # a few steps more: they are redone after the restart
    pids = workers(launcher)
    assert len(pids) == 2, pids
    os.kill(pids[1], sig)
    return launcher, run_dir, time.monotonic(), pids[1]


def assert_same_weights(run_dir: Path, expected: dict[str, torch.Tensor]) -> None:
    got = load_file(run_dir / "model.safetensors")
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in got)


def assert_no_duplicate_steps(run_dir: Path) -> None:
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    counts = collections.Counter((r["step"], r["name"]) for r in rows)
    assert [k for k, n in counts.items() if n > 1] == []
    losses = sorted(int(r["step"]) for r in rows if r["name"] == "train/loss")
    assert losses == list(range(5, 61, 5))


def test_a_killed_worker_is_restarted_and_the_run_ends_bit_exact(tmp_path, straight):
    """Rank 1 killed right after its step 27 (paused there: train_with_faults.py); rank 0
    cannot finish step 28 without it. The restart resumes from step 20 and says that
    exactly 7 steps were redone (each rank writes its last step at every step)."""
    run_dir = tmp_path / "run"
    out_file = tmp_path / "run.out"
    cmd = [sys.executable, TRAIN_WITH_FAULTS, ONE_PROCESS, *ARGS, f"hydra.run.dir={run_dir}"]
    env = {**ENV, "CKPT_TEST_PAUSE_AT": "step@27#1"}
    with out_file.open("w") as log:
        launcher = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + 240
    while "CKPT_TEST_PAUSED" not in out_file.read_text(errors="replace"):
        assert launcher.poll() is None and time.monotonic() < deadline, out_file.read_text()
        time.sleep(0.05)
    paused = out_file.read_text().split("CKPT_TEST_PAUSED", 1)[1].splitlines()[0]
    os.kill(int(paused.rsplit("pid ", 1)[1]), signal.SIGKILL)
    out = finished(launcher, run_dir)
    assert "rank 1 failed first (SIGKILL" in out and "restart 1 of 2" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 60
    (entry,) = summary["recoveries"]
    assert entry["attempt"] == 0 and entry["ranks"] == [1] and entry["cause"] == "SIGKILL"
    assert entry["resumed_from_step"] == 20 and entry["steps_redone"] == 7
    assert 0 <= entry["detected_after_s"] < 30 and entry["seconds_lost"] > 0
    assert (
        "recovered from attempt 0's failure (rank 1: SIGKILL" in (run_dir / "train.log").read_text()
    )
    assert_same_weights(run_dir, straight)
    assert_no_duplicate_steps(run_dir)


def test_a_stopped_worker_is_found_named_and_the_group_restarted(tmp_path, straight):
    launcher, run_dir, stopped_at, pid = fault_after_first_checkpoint(
        tmp_path, signal.SIGSTOP, *SMALL_BUDGETS
    )
    try:
        report = run_dir / "hangs" / "0" / "report_rank0.json"
        wait_for(report, timeout=120)
        detected = time.monotonic() - stopped_at
        out = finished(launcher, run_dir)
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):  # whatever happened, not left stopped
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
    # the bound: the step budget and one poll; the rest is margin for a busy machine
    assert detected < STEP_BUDGET_S + 20, detected
    assert json.loads(report.read_text())["ranks"] == [1]
    assert "hang: rank(s) 1 made no progress" in (run_dir / "train.log").read_text()
    assert "hang: rank(s) 1 made no progress" in out
    stacks = (run_dir / "hangs" / "0" / "rank0.txt").read_text()
    assert "most recent call first" in stacks and "train.py" in stacks
    summary = json.loads((run_dir / "summary.json").read_text())
    (entry,) = summary["recoveries"]
    assert entry["ranks"] == [1] and entry["cause"].startswith("hang in ")
    assert STEP_BUDGET_S - 1 <= entry["detected_after_s"] < STEP_BUDGET_S + 20
    assert_same_weights(run_dir, straight)
    assert_no_duplicate_steps(run_dir)


def test_restarts_exhausted_exit_non_zero_with_the_history(tmp_path):
    """Rank 1 is killed in its 5th step on every attempt: one restart, then the run
    fails, naming rank 1 and keeping both attempts in summary.json."""
    run_dir = tmp_path / "run"
    proc = start(
        run_dir, "model._target_=engine_tests.faults.KilledOnRank1", "parallel.max_restarts=1"
    )
    code = proc.wait(timeout=300)
    out = (tmp_path / "run.out").read_text(errors="replace")
    assert code == 137, out[-5000:]  # 128 + SIGKILL
    assert "rank 1 failed first (SIGKILL" in out and "restarts exhausted" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "best" not in summary
    assert summary["failure"] == {"attempt": 1, "cause": "SIGKILL", "ranks": [1]}
    assert summary["not_restarted"] == "restarts exhausted (parallel.max_restarts)"
    (entry,) = summary["recoveries"]
    assert entry["attempt"] == 0 and entry["ranks"] == [1] and entry["cause"] == "SIGKILL"
    assert entry["resumed_from_step"] == 0  # no checkpoint yet: a fresh start


def test_an_error_the_program_raises_is_not_retried(tmp_path):
    """An exception at a fixed step on rank 1 repeats on a restart: one attempt, its
    real error (type, message, stack) on the console, and summary.json says why."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "model._target_=engine_tests.faults.FailsOnRank1")  # max_restarts=2
    code = proc.wait(timeout=300)
    out = (tmp_path / "run.out").read_text(errors="replace")
    assert code == 1, out[-5000:]
    assert "rank 1 failed first (exit code 1): RuntimeError: injected failure on rank 1" in out
    assert "in forward" in out  # the stack's last lines
    assert "restarting the group" not in out and "attempt 0 failed" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["recoveries"] == []
    assert summary["not_restarted"].startswith("an error the program raised repeats")


def test_torchrun_workers_die_with_their_torchrun(tmp_path):
    """torchrun starts each worker in a session of its own: a kill -9 of torchrun
    must still end them (a parent-death signal), not leave a half-group training."""
    run_dir = tmp_path / "run"
    torchrun = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        "--nproc_per_node",
        "2",
    ]
    args = ["parallel=ddp", "model._target_=engine_tests.faults.Slow", "trainer.max_steps=100000"]
    cmd = [*torchrun, TRAIN, ONE_PROCESS, *args, "preflight=off", f"hydra.run.dir={run_dir}"]
    out = subprocess.DEVNULL
    launcher = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=ENV, stdout=out, stderr=out)
    try:
        logs = [run_dir / "train.log", run_dir / "train_rank1.log"]
        deadline = time.monotonic() + 180
        while not all(p.exists() and "parameters" in p.read_text() for p in logs):
            assert time.monotonic() < deadline, "the workers did not start training"
            time.sleep(0.2)
        kids = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
        pids = []
        for proc in kids:
            try:
                parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if parent == launcher.pid and b"train.py" in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
        assert len(pids) == 2, pids
        launcher.kill()
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if alive(pid)]
    finally:
        launcher.kill()
        launcher.wait()


def test_the_rank_that_found_a_hang_is_the_cause_even_after_its_kill_of_rank_0():
    """Rank 0 stopped: rank 1's watchdog SIGKILLs it, then exits 5 with the report; the
    kill has the earlier timestamp, the report names the cause (a hang of rank 0)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from training_engine.launch import _failure_message, _first_failure

    killed = ProcessFailure(local_rank=0, pid=1, exitcode=-9, error_file="/nonexistent")
    found = ProcessFailure(local_rank=1, pid=2, exitcode=5, error_file="/nonexistent")
    found.message = "hang: rank(s) 0 made no progress (rank 0: after step 42 in step)"
    killed.timestamp, found.timestamp = 100, 101
    err = ChildFailedError("train", {0: killed, 1: found})
    rank, failure = _first_failure(err)
    assert rank == 1
    message = _failure_message(rank, failure)
    assert message.startswith("rank 1 failed first (hang, exit code 5): hang: rank(s) 0 made no")


def test_a_rank_that_lost_its_peer_in_the_same_second_is_not_the_cause():
    """Rank 1 raised; rank 0's collective then failed for the closed connection,
    stamped the same whole second as rank 1's error (elastic's timestamps) or, across
    a second's boundary, the one before: rank 1 is named, not rank 0."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from training_engine.launch import _failure_message, _first_failure

    lost = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="/nonexistent")
    cause = ProcessFailure(local_rank=1, pid=2, exitcode=1, error_file="/nonexistent")
    lost.message = {
        "message": "PreflightFailed: a training step failed: RuntimeError: [gloo/transport/"
        "tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:24227"
    }
    cause.message = {"message": "RuntimeError: injected failure on rank 1"}
    lost.timestamp = cause.timestamp = 100
    err = ChildFailedError("train", {0: lost, 1: cause})
    rank, failure = _first_failure(err)
    assert (rank, failure) == (1, cause)
    assert _failure_message(rank, failure).startswith(
        "rank 1 failed first (exit code 1): RuntimeError: injected failure on rank 1"
    )  # the exit code said once (no traceback in this error file)
    lost.timestamp = 99  # its file written first, in the second before
    assert _first_failure(err)[0] == 1
    cause.message = {"message": "RuntimeError: Connection reset by peer"}
    assert _first_failure(err)[0] == 0  # both lost a peer: the earliest


def test_the_cause_is_named_from_its_error_file_when_the_agent_saw_only_its_peer(
    tmp_path, monkeypatch
):
    """The agent listed only rank 0 (its collective failed when rank 1 closed the
    group; rank 1, still exiting, was not seen): rank 1's recorded error names it."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ErrorHandler,
        ProcessFailure,
    )

    from training_engine.launch import _first_failure

    def recorded(local_rank: int, message: str, attempt: str = "attempt_0") -> str:
        error_file = tmp_path / attempt / str(local_rank) / "error.json"
        error_file.parent.mkdir(parents=True)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        try:
            raise RuntimeError(message)
        except RuntimeError as err:
            ErrorHandler().record_exception(err)  # what record() writes in a worker
        return str(error_file)

    lost = recorded(0, "[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    recorded(1, "injected failure on rank 1")
    (tmp_path / "attempt_0" / "2").mkdir()  # a rank that recorded nothing
    seen = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=lost)
    rank, failure = _first_failure(ChildFailedError("train", {0: seen}))
    assert rank == 1
    assert "injected failure on rank 1" in failure.message["message"]
    # a listed cause (rank 1 stopped by SIGTERM, 143) is named: the file that rank 0
    # wrote on its own stop, not yet seen, is not read as a failure (exit 1)
    recorded(0, "TrainingInterrupted: SIGTERM received", attempt="attempt_1")
    signalled = recorded(1, "TrainingInterrupted: SIGTERM received", attempt="attempt_1")
    stopped = ProcessFailure(local_rank=1, pid=2, exitcode=143, error_file=signalled)
    rank, failure = _first_failure(ChildFailedError("train", {1: stopped}))
    assert (rank, failure.exitcode) == (1, 143)
