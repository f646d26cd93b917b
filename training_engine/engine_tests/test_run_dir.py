"""The run directory (run_dir.py): unique per launch, never another run's, a
finished run left as it is, found from any working directory; and bad input
refused before any work. Real train.py processes."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save as save_safetensors

from training_engine.checkpoint.checksums import file_entry
from training_engine.claim import (
    ATTEMPT,
    _lock,
    _unlock,
    inspect,
    reopen_the_end,
)
from training_engine.config import resolve_config
from training_engine.files import write_json_atomic
from training_engine.run_dir import RunDirError, launch_stamp

from .conftest import ENV, FAST, ONE_PROCESS, PROJECT_ROOT, run_train, wait_for

TRAIN = str(PROJECT_ROOT / "train.py")
SHORT = [*FAST, "trainer.max_steps=20"]


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (names included), to prove nothing changed."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def train(cwd: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, TRAIN, ONE_PROCESS, *overrides],
        cwd=cwd,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_launch_stamp_is_unique_per_launch_and_the_same_within_one():
    assert launch_stamp() == launch_stamp()  # this process: one launch
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from {launch_stamp.__module__} import launch_stamp as f; print(f())",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        check=True,
    ).stdout.strip()
    # its own id, and a start no earlier than this process's: not "the same day", which a
    # test session running across midnight broke (this worker 23:48, the child 00:09)
    mine = launch_stamp()
    assert other != mine and other[-6:] != mine[-6:]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-[0-9a-f]{6}", other), other
    assert other[:19] >= mine[:19]  # zero-padded: in time order as strings


def test_three_launches_in_the_same_second_get_three_run_dirs(tmp_path):
    runs = tmp_path / "runs"
    rates = ["0.001", "0.003", "0.01"]
    procs = [train(tmp_path, *SHORT, f"runs_root={runs}", f"optimizer.lr={lr}") for lr in rates]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    dirs = sorted(p.parent for p in runs.rglob("summary.json"))
    assert len(dirs) == 3
    seen = set()
    for d in dirs:
        config = json.loads((d / "config.json").read_text())
        seen.add(str(config["optimizer"]["lr"]))
        assert (
            f"optimizer.lr={config['optimizer']['lr']}" in (d / ".hydra/overrides.yaml").read_text()
        )
        summary = json.loads((d / "summary.json").read_text())
        assert summary["step"] == 20 and summary["world_size"] == 1
        steps = [
            line for line in (d / "metrics.csv").read_text().splitlines() if ",val/acc," in line
        ]
        assert len(steps) == 2  # its own evaluations only (10, 20): nothing interleaved
    assert seen == {str(float(r)) for r in rates}


def test_another_runs_directory_is_refused_and_left_unchanged(tmp_path):
    first = run_train(tmp_path / "run", *SHORT)
    before = tree_digest(first.run_dir)
    other = run_train(first.run_dir, *SHORT, "model.width=64", "seed=3", check=False)
    assert other.proc.returncode == 2, other.output[-2000:]
    assert f"{first.run_dir} holds another run" in other.output
    assert "model.width: 128 -> 64" in other.output and "seed: 42 -> 3" in other.output
    assert "Use another run_name" in other.output and "Traceback" not in other.output
    assert tree_digest(first.run_dir) == before
    # A directory with files that are no run of ours is not written into either.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    refused = run_train(foreign, *SHORT, check=False)
    assert refused.proc.returncode == 2 and "holds no run of this project" in refused.output
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_a_finished_run_rerun_changes_nothing_and_a_longer_one_continues(tmp_path):
    first = run_train(tmp_path / "run", *SHORT)
    before = tree_digest(first.run_dir)
    again = run_train(first.run_dir, *SHORT)
    assert "is a finished run (step 20" in again.output and "nothing changed" in again.output
    assert tree_digest(first.run_dir) == before
    # checkpoint.resume=never there would mix two runs: refused, nothing changed.
    never = run_train(first.run_dir, *SHORT, "checkpoint.resume=never", check=False)
    assert never.proc.returncode == 2 and "checkpoint.resume=never, but" in never.output
    assert tree_digest(first.run_dir) == before
    # trainer.max_steps grew: the same run continues from its last checkpoint.
    ckpt = first.run_dir / "checkpoints" / "step_0000020"
    trained_before = json.loads((ckpt / "trainer_state.json").read_text())["stateful"]["clock"]
    longer = run_train(first.run_dir, *SHORT, "trainer.max_steps=30")
    summary = longer.summary
    assert summary["step"] == 30 and summary["resumed_from"] == str(ckpt)
    # summary.json describes the whole run: the first attempt's training time is in it.
    assert summary["wall_time_s"] > trained_before["train_s"] > 0
    # Both are rounded to 1 ms / 0.001 (a 0.19 s run: 30 / 0.190 is 0.26 % off 30 / 0.1903)
    wall = summary["wall_time_s"]
    assert 30 / (wall + 5e-4) - 5e-4 <= summary["steps_per_sec"] <= 30 / (wall - 5e-4) + 5e-4


def test_only_a_started_attempt_says_what_the_run_is(compose_cfg, tmp_path):
    """The claim stages the attempt's config in .attempt/; it becomes the run's
    config.json when training starts. An attempt killed before that leaves .attempt/
    behind: the same config takes the directory as new, another config is refused,
    and a committed run is judged by its config.json only."""
    cfg = resolve_config(compose_cfg("checkpoint.resume=never"))
    run_dir = tmp_path / "run"
    (run_dir / ATTEMPT).mkdir(parents=True)
    write_json_atomic(run_dir / ATTEMPT / "config.json", OmegaConf.to_container(cfg))
    (run_dir / "train.log").write_text("killed before its first step")  # a diagnostic
    assert inspect(run_dir, cfg).kind == "new"
    (run_dir / "metrics.csv").write_text("time,step,name,value\n")  # not a diagnostic
    assert inspect(run_dir, cfg).kind == "new"  # the same config: the same attempt again
    other = resolve_config(compose_cfg("seed=7"))
    with pytest.raises(RunDirError, match="holds no run of this project"):
        inspect(run_dir, other)
    (run_dir / "notes.txt").write_text("someone else's")  # leftovers aside, no run here
    write_json_atomic(run_dir / "config.json", OmegaConf.to_container(cfg, resolve=True))
    with pytest.raises(RunDirError, match=r"checkpoint\.resume=never, but"):
        inspect(run_dir, cfg)
    (run_dir / "config.json").write_text("[" * 200_000)  # hostile: never parsed deep
    with pytest.raises(RunDirError, match="not a config this project wrote"):
        inspect(run_dir, cfg)


def test_finished_means_a_summary_and_the_weights_it_records(compose_cfg, tmp_path, caplog):
    """claim's "finished" (issue 38): summary.json and the model.safetensors whose size
    and checksum it records. Without them it is an end cut short: "continue", and the
    log says how the rerun completes it; with checkpoint=none, by training again.
    In-process: the claim's decision and the clean-up when training starts."""
    cfg = resolve_config(compose_cfg())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_json_atomic(run_dir / "config.json", OmegaConf.to_container(cfg, resolve=True))
    weights = save_safetensors({"w": torch.arange(6.0)})
    best = {"name": "val/acc", "value": 0.9, "step": 30}
    write_json_atomic(
        run_dir / "summary.json", {"step": 30, "best": best, "final_weights": file_entry(weights)}
    )
    assert inspect(run_dir, cfg).kind == "continue"  # no weights
    assert "model.safetensors is missing: its end was cut short" in caplog.text
    (run_dir / "model.safetensors").write_bytes(weights)
    assert inspect(run_dir, cfg).finished
    (run_dir / "model.safetensors").write_bytes(weights[:-1] + b"x")  # same size, other bytes
    assert inspect(run_dir, cfg).kind == "continue"
    # A summary of an older engine records no weights: complete safetensors suffice.
    write_json_atomic(run_dir / "summary.json", {"step": 30, "best": best})
    assert inspect(run_dir, cfg).finished
    (run_dir / "model.safetensors").write_bytes(weights[:-4])  # cut short
    caplog.clear()
    none = resolve_config(compose_cfg("checkpoint=none"))
    assert inspect(run_dir, none).kind == "continue"
    assert "checkpoint=none kept no checkpoint to complete it from" in caplog.text
    # Training starts again (commit_attempt): a summary saying finished goes (else an
    # extended run killed before its end would read as finished at its old length),
    # and so does what a killed end left half-written; a failed run's record stays.
    (run_dir / ".model.safetensors.tmp").write_bytes(weights[:5])
    (run_dir / ".summary.json.tmp").write_text('{"st')
    reopen_the_end(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "model.safetensors"]
    write_json_atomic(run_dir / "summary.json", {"status": "failed", "recoveries": []})
    reopen_the_end(run_dir)
    assert (run_dir / "summary.json").is_file()


def test_a_live_run_dir_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    slow = ["model._target_=engine_tests.faults.Slow", "trainer.max_steps=100000"]
    live = train(tmp_path, *SHORT, *slow, f"hydra.run.dir={run_dir}")
    try:
        wait_for(run_dir / "metrics.csv")
        second = run_train(run_dir, *SHORT, *slow, check=False)
        assert second.proc.returncode == 2
        assert f"{run_dir} is in use by another training process" in second.output
    finally:
        live.kill()
        live.wait()


def test_the_lock_dies_with_the_run_not_with_its_forked_workers(tmp_path):
    """A DataLoader worker is a fork of the run: after a kill -9 of the run it lives
    on for seconds. Its inherited copy of the lock must not refuse the resume."""
    fd = _lock(tmp_path)
    with pytest.raises(RunDirError, match="in use by another training process"):
        _lock(tmp_path)  # a live run holds it
    ready_r, ready_w = os.pipe()
    worker = os.fork()
    if worker == 0:  # the "worker": outlives the run's lock by far
        os.write(ready_w, b"1")  # after fork's hooks (they run before fork returns here)
        time.sleep(30)
        os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"1"  # the worker is up: its at-fork hooks have run
        _unlock(fd)  # the run ends (kill -9 closes its fds the same way)
        _unlock(_lock(tmp_path))  # free at once, though the worker still runs
        assert os.waitpid(worker, os.WNOHANG) == (0, 0)  # still running
    finally:
        os.kill(worker, 9)
        os.waitpid(worker, 0)
        os.close(ready_r)
        os.close(ready_w)


def test_runs_root_is_the_project_root_whatever_the_working_directory(tmp_path):
    name = f"test-{uuid.uuid4().hex[:8]}"
    run_dir = PROJECT_ROOT / "runs" / name
    try:
        for cwd in (tmp_path, Path("/")):
            proc = train(cwd, *SHORT, f"run_name={name}")
            out = proc.communicate(timeout=300)[0]
            assert proc.returncode == 0, out[-2000:]
        assert json.loads((run_dir / "summary.json").read_text())["step"] == 20
        assert "is a finished run" in out  # the second start, from /, found the first's run
        assert not (tmp_path / "runs").exists()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


BAD_INPUT = {
    "cpu_processes=abc": (
        ["parallel=ddp", "parallel.cpu_processes=abc"],
        "parallel.cpu_processes='abc' is not allowed: expected an integer >= 1",
    ),
    "cpu_processes=0": (
        ["parallel=ddp", "parallel.cpu_processes=0"],
        "parallel.cpu_processes=0 is not allowed: expected an integer >= 1",
    ),
    "num_processes": (
        ["parallel=ddp", "parallel.num_processes=-1"],
        "parallel.num_processes=-1 is not allowed: expected auto or an integer >= 1",
    ),
    "node_rank": (
        ["parallel=ddp", "parallel.num_nodes=2", "parallel.node_rank=2", "parallel.master_port=1"],
        "parallel.node_rank=2 is not allowed: expected 0..1",
    ),
    "multi-node default name": (
        ["parallel=ddp", "parallel.num_nodes=2", "parallel.master_port=29555"],
        "a run on several nodes needs one run directory",
    ),
    "data path": (
        ["+data.train_file=/no/such/tokens.bin"],
        "data.train_file='/no/such/tokens.bin' is not allowed: no such file or directory",
    ),
    "missing data file": (
        ["data._target_=engine_tests.faults.data_from_a_missing_file"],
        "data: no such file or directory: /no/such/file.csv",
    ),
    "model": (["model._target_=torch.nn.Linear"], "model: cannot build torch.nn.Linear"),
    "monitor": (["trainer.monitor=val/f1"], "trainer.monitor='val/f1' is not a logged metric"),
    # Hydra's own errors about the command line (entry.py)
    "typo": (
        ["trainer.max_step=10"],
        "trainer.max_step=10 is not a key of the config: did you mean trainer.max_steps",
    ),
    "option": (
        ["tracker=foo"],
        "tracker=foo is not an option: choose one of csv, mlflow, none, tensorboard, wandb",
    ),
    # interpolations: a data file that is not there, a key the data option does not have
    "token file": (
        ["model=gpt", "data=token_file", "data.train_path=/no/such/train.bin"],
        "the data file /no/such/train.bin does not exist",
    ),
    "no vocab_size": (
        ["model=gpt"],
        "model.vocab_size='${data.vocab_size}' reads data.vocab_size, which this config does not "
        "have",
    ),
    # several value errors at once, a type Hydra refuses among them: each named, one exit
    "values": (
        ["seed=abc", "trainer.max_steps=abc", "checkpoint.keep_last=-1"],
        "trainer.max_steps='abc' is not allowed: expected an integer >= 1 or null\n  "
        "checkpoint.keep_last=-1 is not allowed: expected an integer >= 2 (the newest checkpoint "
        "may be the one a crash interrupted)\n  seed='abc' is not allowed: expected an integer "
        "in [0, 2**32)",
    ),
    "vocabulary": (
        ["model=gpt", "data=tokens", "model.vocab_size=100", "data.num_train=64"],
        "the model's input embedding has 100 rows, but data.vocab_size=256",
    ),
    "positions": (
        ["model=gpt", "data=tokens", "model.seq_len=64", "data.num_train=64"],
        "data.seq_len=128 is not allowed with this model: it takes at most 64 positions",
    ),
    "tracking server": (
        ["tracker=mlflow", "tracker.mlflow.tracking_uri=http://127.0.0.1:9"],
        "tracker.mlflow.tracking_uri='http://127.0.0.1:9' is not reachable (Connection refused)",
    ),
    "run_name up": (["run_name=../x"], "run_name='../x' is not allowed: expected a name inside"),
    "run_name around": (["run_name=a/../../../x"], "run_name='a/../../../x' is not allowed"),
}


def tree(root: Path) -> dict[str, str]:
    """Every path under ``root``, folders included, with each file's digest."""
    return {
        p.relative_to(root).as_posix(): (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        )
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_exits_2_naming_the_value_and_writes_nothing(tmp_path, case):
    overrides, expected = BAD_INPUT[case]
    runs = tmp_path / "project" / "runs"
    (runs / "earlier").mkdir(parents=True)
    (runs / "earlier" / "notes.txt").write_text("an earlier run")
    before = tree(tmp_path)
    proc = train(tmp_path, *SHORT, "trainer.max_steps=5", f"runs_root={runs}", *overrides)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2, out[-3000:]
    assert expected in out and "Traceback" not in out
    assert "step 5/5" not in out  # refused before the first step
    assert tree(tmp_path) == before  # nothing made, nothing changed, inside runs/ or out


def test_a_read_only_place_is_refused_with_exit_2_and_left_as_it_was(tmp_path):
    """A runs_root and a run dir on a read-only file system: one clear error (exit 2),
    the finished run in it unchanged."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    place = tmp_path / "ro"
    place.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(place)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        run_train(place / "done", *SHORT)
        subprocess.run(["mount", "-o", "remount,ro", str(place)], check=True)
        before = tree(place)
        new = train(tmp_path, *SHORT, f"runs_root={place / 'runs'}")
        out = new.communicate(timeout=300)[0]
        assert new.returncode == 2 and "Traceback" not in out, out[-2000:]
        assert f"cannot make the run dir {place / 'runs'}" in out and "Read-only file system" in out
        longer = run_train(place / "done", *SHORT, "trainer.max_steps=30", check=False)
        assert longer.proc.returncode == 2 and "Traceback" not in longer.output
        assert f"cannot use {place / 'done'} as the run dir: Read-only file system" in longer.output
        assert tree(place) == before
    finally:
        subprocess.run(["umount", str(place)], check=True)


@pytest.mark.multiprocess
def test_two_launchers_extend_a_finished_run_and_stop_together_when_they_disagree(tmp_path):
    """Seen before: extending a finished 2-node run with the same two commands, node 1
    read the config.json node 0 had just rewritten, called the run finished and left;
    node 0 waited 901 s at the rendezvous. One decision per launch, every node takes it."""
    from .test_parallel import finish, free_port, start_nodes

    run_dir = tmp_path / "run"
    nodes = start_nodes(tmp_path, [run_dir, run_dir], free_port(), *SHORT)
    outputs = finish(nodes)
    assert [n.returncode for n in nodes] == [0, 0], outputs
    again = start_nodes(tmp_path, [run_dir, run_dir], free_port(), *SHORT)  # finished
    outputs = finish(again, timeout=120)
    assert [n.returncode for n in again] == [0, 0], outputs
    assert "is a finished run (step 20" in outputs[0] + outputs[1]
    longer = start_nodes(tmp_path, [run_dir, run_dir], free_port(), *SHORT, "trainer.max_steps=30")
    outputs = finish(longer, timeout=180)
    assert [n.returncode for n in longer] == [0, 0], outputs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 30 and summary["world_size"] == 2 and summary["resumed_from"]

    # Two nodes started with other values: both stop at once, with the same reason.
    other, port = tmp_path / "other", free_port()
    start = time.monotonic()
    node = ["parallel=ddp", "parallel.num_processes=1", "parallel.num_nodes=2"]
    node += ["parallel.master_addr=127.0.0.1", f"parallel.master_port={port}", *SHORT]
    differing = [
        subprocess.Popen(
            [sys.executable, TRAIN, ONE_PROCESS, *node, f"parallel.node_rank={rank}", steps,
             f"hydra.run.dir={other}"],
            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank, steps in ((0, "trainer.max_steps=30"), (1, "trainer.max_steps=40"))
    ]  # fmt: skip
    outputs = finish(differing, timeout=120)
    assert [n.returncode for n in differing] == [2, 2], outputs
    assert time.monotonic() - start < 90
    for out in outputs:
        assert "rank 1: trainer.max_steps: 30 -> 40" in out and "Traceback" not in out
    # A new run dir whose attempt never started is taken back (an empty folder may stay:
    # two launchers race to make it, and each removes only what it made itself).
    assert not other.exists() or not [p for p in other.rglob("*") if p.is_file()]


def test_a_failed_attempt_changes_nothing_and_the_next_one_extends_the_run(tmp_path):
    """An attempt that fails after the claim, before its first step (here: its data
    refuses a value the claim allows to change), leaves config.json and .hydra/ as they
    were; the next valid attempt extends the run instead of being told it is finished."""
    run_dir = tmp_path / "run"
    run_train(run_dir, *SHORT)
    said = {p: tree(run_dir)[p] for p in ("config.json", "config.yaml", ".hydra/overrides.yaml")}
    failed = run_train(
        run_dir, *SHORT, "trainer.max_steps=30", "data.val_batch_size=0", check=False
    )
    assert failed.proc.returncode == 2 and "Traceback" not in failed.output
    assert "data.val_batch_size=0 is not allowed" in failed.output
    assert {p: tree(run_dir)[p] for p in said} == said and not (run_dir / ".attempt").exists()
    longer = run_train(run_dir, *SHORT, "trainer.max_steps=30")
    assert longer.summary["step"] == 30 and "is a finished run" not in longer.output
    assert json.loads((run_dir / "config.json").read_text())["trainer"]["max_steps"] == 30


def test_the_history_of_recoveries_is_kept_across_launches(tmp_path, monkeypatch):
    """Each launch numbers its attempts from 0 again (hangs/0/ is reused): the run's
    recoveries.json keeps every launch's recovery, and the summary lists them all."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from training_engine import recovery
    from training_engine.watchdog import attempt_dir

    accelerator = Accelerator(cpu=True)
    for launch, step in enumerate((20, 40)):
        failed = attempt_dir(tmp_path, 0)  # this launch's first attempt failed at `step`
        failed.mkdir(parents=True, exist_ok=True)
        beat = {"rank": 1, "step": step + 5, "progress_at": 1, "alive_at": 2, "started_at": 0}
        (failed / "beat_rank1.json").write_text(json.dumps(beat))
        recovery.note_failure(tmp_path, 0, rank=1, exit_code=-9, message="killed")
        monkeypatch.setenv("TRAIN_ATTEMPT", "1")  # the restarted attempt
        plan = SimpleNamespace(checkpoint=None, step=step)
        entry = recovery.note_recovery(tmp_path, plan, accelerator)
        assert entry["cause"] == "SIGKILL" and entry["steps_redone"] == 5
        resumed = [e["resumed_from_step"] for e in recovery.history(tmp_path)]
        assert resumed == [20, 40][: launch + 1]
    (tmp_path / "recoveries.json").write_text("{not json")
    assert recovery.history(tmp_path) == []  # malformed: none, never a crash
