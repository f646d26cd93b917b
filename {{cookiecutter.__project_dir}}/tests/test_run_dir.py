"""The run directory (run_dir.py): unique per launch, never another run's, a
finished run left as it is, found from any working directory; and bad input
refused before any work. Real train.py processes."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from {{ cookiecutter.package_name }}.engine.config import resolve_config
from {{ cookiecutter.package_name }}.engine.run_dir import (
    RunDirError,
    _lock,
    _unlock,
    inspect,
    launch_stamp,
    write_json_atomic,
)

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
    assert other != launch_stamp() and other[:10] == launch_stamp()[:10]  # same day, own id


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


def test_the_other_processes_of_a_launch_look_while_the_main_one_claims(compose_cfg, tmp_path):
    """Seen in CI: rank 1 of a 2-task SLURM job looked while rank 0 was writing
    its claim (``.hydra/``, ``.config.yaml.tmp``), called the directory another
    run's and left; rank 0 then waited for it. The other processes count what the
    main one writes as a new run, and leave the resume=never refusal to it."""
    cfg = resolve_config(compose_cfg("checkpoint.resume=never"))
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("{}")
    (run_dir / ".config.yaml.tmp").write_text("partial")  # main, mid-write
    assert inspect(run_dir, cfg, main=False) == ("new", None)
    with pytest.raises(RunDirError, match="holds no run of this project"):
        inspect(run_dir, cfg)  # to the main process this is another run's
    (run_dir / "notes.txt").write_text("someone else's")  # not a claim file: refused by all
    with pytest.raises(RunDirError, match="holds no run of this project"):
        inspect(run_dir, cfg, main=False)
    (run_dir / "notes.txt").unlink()
    write_json_atomic(run_dir / "config.json", OmegaConf.to_container(cfg, resolve=True))
    assert inspect(run_dir, cfg, main=False) == ("continue", None)  # main's fresh config.json
    with pytest.raises(RunDirError, match=r"checkpoint\.resume=never, but"):
        inspect(run_dir, cfg)


def test_a_live_run_dir_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    slow = ["model._target_=tests.faults.Slow", "trainer.max_steps=100000"]
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
        ["data._target_=tests.faults.data_from_a_missing_file"],
        "data: no such file or directory: /no/such/file.csv",
    ),
    "model": (["model._target_=torch.nn.Linear"], "model: cannot build torch.nn.Linear"),
    "monitor": (["trainer.monitor=val/f1"], "trainer.monitor='val/f1' is not a logged metric"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_exits_2_naming_the_value_and_writes_nothing(tmp_path, case):
    overrides, expected = BAD_INPUT[case]
    runs = tmp_path / "runs"
    proc = train(tmp_path, *SHORT, "trainer.max_steps=5", f"runs_root={runs}", *overrides)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2, out[-3000:]
    assert expected in out and "Traceback" not in out
    assert "step 5/5" not in out  # refused before the first step
    assert not [p for p in runs.rglob("*") if p.is_file()]  # no half-made run dir
