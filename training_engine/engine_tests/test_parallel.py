"""Real multi-process runs on CPU (gloo): self-launch, torchrun, accelerate
launch, multirun, two nodes, failures, no orphans."""

import csv
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import ENV, FAST, ONE_PROCESS, PROJECT_ROOT, fingerprints, wait_for

pytestmark = pytest.mark.multiprocess

TRAIN = str(PROJECT_ROOT / "train.py")
BIN = Path(sys.executable).parent
PYTHON = [sys.executable]
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2"]
ACCELERATE = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2"]
ACCELERATE += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def command(*overrides: str, launcher: list[str] = PYTHON) -> list[str]:
    flags = [o for o in overrides if o.startswith("-")]  # -m: Hydra's flags come first
    rest = [o for o in overrides if not o.startswith("-")]
    return [*launcher, TRAIN, *flags, ONE_PROCESS, *rest]


def run(cwd: Path, *overrides: str, launcher: list[str] = PYTHON) -> subprocess.CompletedProcess:
    """train.py under ``launcher`` in ``cwd``; its runs/ land in cwd/runs/."""
    cmd = command(*overrides, f"runs_root={cwd / 'runs'}", launcher=launcher)
    return subprocess.run(
        cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300, check=False
    )


def start(cwd: Path, *overrides: str) -> subprocess.Popen:
    """train.py in the background (output discarded), to be signalled."""
    out = subprocess.DEVNULL
    cmd = command(*overrides, f"runs_root={cwd / 'runs'}")
    return subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=out, stderr=out)


def ok(proc: subprocess.CompletedProcess) -> str:
    """Exit 0, and no process aborted on its way out (a worker aborting in the
    process group's teardown would print this while the run still exits 0)."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "terminate called" not in out and "Aborted" not in out, out[-5000:]
    return out


def only_run_dir(cwd: Path) -> Path:
    """The single run directory a run created under cwd/runs/."""
    summaries = list((cwd / "runs").rglob("summary.json"))
    assert len(summaries) == 1, summaries
    return summaries[0].parent


def assert_two_rank_run(run_dir: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    prints = fingerprints(run_dir)
    assert set(prints) == {"train.log", "train_rank1.log"}
    assert len(set(prints.values())) == 1, prints  # identical parameters on both ranks


def test_self_launched_ddp(tmp_path):
    ok(run(tmp_path, "parallel=ddp", *FAST))
    run_dir = only_run_dir(tmp_path)
    assert_two_rank_run(run_dir)
    assert (run_dir / "config.json").is_file() and (run_dir / ".hydra").is_dir()


@pytest.mark.parametrize("launcher", [TORCHRUN, ACCELERATE], ids=["torchrun", "accelerate"])
def test_external_launchers_make_one_run_dir(tmp_path, launcher):
    ok(run(tmp_path, "parallel=ddp", *FAST, launcher=launcher))
    assert_two_rank_run(only_run_dir(tmp_path))


def train_losses(run_dir: Path) -> dict[int, float]:
    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return {int(r["step"]): float(r["value"]) for r in rows if r["name"] == "train/loss"}


def test_ddp_matches_one_process_with_the_same_global_batch(tmp_path):
    # No dropout (its masks differ per rank by design); 20 steps stay inside the
    # first epoch, before the last, partial batch.
    common = [*FAST, "trainer.max_steps=20", "model.dropout=0.0"]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    ok(run(tmp_path, f"hydra.run.dir={single}", "data.batch_size=64", *common))
    ok(run(tmp_path, f"hydra.run.dir={ddp}", "parallel=ddp", "data.batch_size=32", *common))
    a, b = train_losses(single), train_losses(ddp)
    assert sorted(a) == sorted(b) == [5, 10, 15, 20]
    assert all(abs(a[s] - b[s]) < 1e-5 for s in a), (a, b)
    wa, wb = load_file(single / "model.safetensors"), load_file(ddp / "model.safetensors")
    assert all((wa[k] - wb[k]).abs().max() < 1e-4 for k in wa)


def test_multirun_with_ddp(tmp_path):
    sweep = tmp_path / "sweep"
    ok(run(tmp_path, "-m", "parallel=ddp", "seed=1,2", *FAST, f"hydra.sweep.dir={sweep}"))
    for job in ("0", "1"):
        assert_two_rank_run(sweep / job)
    seeds = {json.loads((sweep / j / "config.json").read_text())["seed"] for j in "01"}
    assert seeds == {1, 2}
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert sorted(r["status"] for r in rows) == ["completed", "completed"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(cwd: Path, run_dirs: list[Path], port: int, *overrides: str) -> list:
    """Two "nodes" on this machine: one launcher each, one worker per node."""
    node = ["parallel=ddp", "parallel.num_processes=1", "parallel.num_nodes=2"]
    node += ["parallel.master_addr=127.0.0.1", f"parallel.master_port={port}", *overrides]
    return [
        subprocess.Popen(
            command(*node, f"parallel.node_rank={rank}", f"hydra.run.dir={run_dirs[rank]}"),
            cwd=cwd,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]


def finish(nodes: list, timeout: float = 300) -> list[str]:
    """Each node's output once it exits; a node still running after `timeout` is
    killed with the others (a hang must not leave processes loading the machine)."""
    try:
        return [n.communicate(timeout=timeout)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.communicate()


# Two nodes with everything a user gets by default (preflight, checkpoints),
# slow enough steps to be killed mid-run.
NODES = [
    "trainer.max_steps=40",
    "trainer.log_every_n_steps=5",
    "trainer.eval_every_n_steps=10",
    "checkpoint.every_n_steps=10",
    "tracker=csv",
    "model._target_=engine_tests.faults.Slow",
]


def test_two_nodes_run_and_resume_after_kill_9_bit_exactly(tmp_path):
    """With default preflight; SIGKILL of both nodes mid-run, the same two
    commands again: resumed, and the weights of an uninterrupted 2-node run."""
    straight = tmp_path / "straight"  # on a cluster: a shared filesystem
    nodes = start_nodes(tmp_path, [straight, straight], free_port(), *NODES)
    outputs = finish(nodes)
    assert [n.returncode for n in nodes] == [0, 0], outputs
    assert_two_rank_run(straight)
    assert (straight / "preflight.json").is_file()
    expected = fingerprints(straight)["train.log"]

    run_dir, port = tmp_path / "killed", free_port()
    nodes = start_nodes(tmp_path, [run_dir, run_dir], port, *NODES)
    try:
        wait_for(run_dir / "checkpoints" / "step_0000020", timeout=240)
    finally:
        for n in nodes:
            n.kill()
            n.communicate()
    assert not (run_dir / "summary.json").exists()
    nodes = start_nodes(tmp_path, [run_dir, run_dir], port, *NODES)  # the same commands
    outputs = finish(nodes)
    assert [n.returncode for n in nodes] == [0, 0], outputs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] and summary["step"] == 40
    assert fingerprints(run_dir) == {"train.log": expected, "train_rank1.log": expected}


def test_node_local_run_dirs_stop_before_training_with_the_reason(tmp_path):
    """Each node its own run dir (no shared storage): refused on both, nothing trained."""
    dirs = [tmp_path / "node0" / "run", tmp_path / "node1" / "run"]
    nodes = start_nodes(tmp_path, dirs, free_port(), *FAST)
    outputs = finish(nodes)
    assert [n.returncode for n in nodes] == [2, 2], outputs
    assert "the run directory is not shared by every process: rank 1" in outputs[0]
    assert "put the runs on shared storage" in outputs[0]
    for d in dirs:
        assert not (d / "checkpoints").exists() and not (d / "summary.json").exists()


def test_a_failing_rank_fails_the_run_with_its_traceback(tmp_path):
    start = time.monotonic()
    # no in-job restarts here (test_recovery.py has them): the first failure ends the run
    args = ["model._target_=engine_tests.faults.FailsOnRank1", "parallel.max_restarts=0", *FAST]
    proc = run(tmp_path, "parallel=ddp", *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert "rank 1 failed" in out
    assert "injected failure on rank 1" in out and "Traceback" in out
    assert time.monotonic() - start < 60


def children_of(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_no_worker_outlives_its_launcher(tmp_path, sig):
    run_dir = tmp_path / "run"
    args = ["parallel=ddp", "model._target_=engine_tests.faults.Slow", "trainer.max_steps=100000"]
    launcher = start(tmp_path, *args, f"hydra.run.dir={run_dir}")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until both ranks are training
            logs = [run_dir / "train.log", run_dir / "train_rank1.log"]
            if all(p.exists() and "parameters" in p.read_text() for p in logs):
                break
            time.sleep(0.2)
        workers = [p for p in children_of(launcher.pid) if alive(p)]
        workers = [w for w in workers if "spawn" in Path(f"/proc/{w}/cmdline").read_text()]
        assert len(workers) == 2
        launcher.send_signal(sig)
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 30
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(w) for w in workers)
        assert launcher.returncode != 0
    finally:
        launcher.kill()
        launcher.wait()


def test_parallel_none_under_a_two_process_launcher_is_refused(tmp_path):
    proc = run(tmp_path, "parallel=none", *FAST, launcher=TORCHRUN)
    assert proc.returncode != 0
    assert "parallel=none, but the launcher started 2 processes" in proc.stdout + proc.stderr


@pytest.mark.slow  # 300 s on 2 cores; in CI, ok() checks every multi-process run's exit
def test_teardown_never_aborts_in_20_runs(tmp_path):
    """20 DDP runs, 40 worker exits, none aborts in the process group's teardown.
    One multirun: the runs share one launcher process (its start-up is ~1/3 of
    a 3-step run); every run starts and ends its own workers."""
    sweep = tmp_path / "sweep"
    steps = ["trainer.max_steps=3", "preflight=off"]
    out = ok(
        run(tmp_path, "-m", "parallel=ddp", "seed=range(20)", *steps, f"hydra.sweep.dir={sweep}")
    )
    assert "terminate called" not in out and "Aborted" not in out
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [r["status"] for r in rows] == ["completed"] * 20
    seeds = [json.loads((sweep / str(j) / "config.json").read_text())["seed"] for j in range(20)]
    assert seeds == list(range(20))
    for job in range(20):
        assert_two_rank_run(sweep / str(job))


def test_fsdp_trains_the_same_weights_as_ddp(tmp_path):
    """accelerate's FSDP2 path on CPU (see accel.py): sharded DTensor parameters,
    reduce-scatter instead of all-reduce, the same math: identical weights."""
    common = [*FAST, "model.dropout=0.0"]
    fsdp, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    ok(
        run(
            tmp_path,
            f"hydra.run.dir={fsdp}",
            "parallel=fsdp",
            *common,
            "parallel.auto_wrap_min_params=1000",
        )
    )
    ok(run(tmp_path, f"hydra.run.dir={ddp}", "parallel=ddp", *common))
    assert_two_rank_run(fsdp)
    assert "world size 2 (FSDP)" in (fsdp / "train.log").read_text()
    wa, wb = load_file(fsdp / "model.safetensors"), load_file(ddp / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert train_losses(fsdp) == train_losses(ddp)


HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs the deepspeed extra")
def test_deepspeed_zero2_trains_the_same_weights_as_ddp(tmp_path):
    """ZeRO-2 averages the gradients in its own flat buffers (a different order
    of the same float operations): the losses agree to 1e-6 and the weights to
    a few float32 ulps (measured: at most 3e-8), not bit for bit."""
    common = [*FAST, "model.dropout=0.0"]
    ds, ddp = tmp_path / "deepspeed", tmp_path / "ddp"
    ok(run(tmp_path, f"hydra.run.dir={ds}", "parallel=deepspeed", "checkpoint=none", *common))
    ok(run(tmp_path, f"hydra.run.dir={ddp}", "parallel=ddp", "checkpoint=none", *common))
    assert_two_rank_run(ds)
    assert "world size 2 (DEEPSPEED)" in (ds / "train.log").read_text()
    a, b = train_losses(ds), train_losses(ddp)
    assert sorted(a) == sorted(b) and all(abs(a[s] - b[s]) < 1e-6 for s in a), (a, b)
    wa, wb = load_file(ds / "model.safetensors"), load_file(ddp / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all((wa[k] - wb[k]).abs().max() < 1e-6 for k in wa)


# FSDP's (5 runs, 200 s) runs with -m slow: in CI, FSDP's SIGTERM and kill -9 resumes
# are test_pod_contract's, its sharded checkpoints test_sharded's and test_fsdp's.
@pytest.mark.parametrize("mode", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_resume_after_the_launcher_is_killed_or_stopped_is_bit_exact(tmp_path, mode):
    """SIGKILL of the launcher: resume from the last periodic checkpoint.
    SIGTERM (and Ctrl-C): every rank saves at the next step boundary, exits
    143 (130), resume. After the kill, rank 1's RNG file of the newest checkpoint
    is damaged: both ranks resume from the one before.
    Both end with the weights of the uninterrupted run."""
    args = [f"parallel={mode}", "model._target_=engine_tests.faults.Slow", "trainer.max_steps=60"]
    args += ["checkpoint.every_n_steps=10", "trainer.log_every_n_steps=10"]
    if mode == "fsdp":
        args.append("parallel.auto_wrap_min_params=1000")
    straight = tmp_path / "straight"
    ok(run(tmp_path, *args, f"hydra.run.dir={straight}"))
    expected = fingerprints(straight)["train.log"]

    stops = [(signal.SIGKILL, -9), (signal.SIGTERM, 143)]
    if mode == "ddp":
        stops.append((signal.SIGINT, 130))  # Ctrl-C: saved like SIGTERM
    for sig, code in stops:
        run_dir = tmp_path / sig.name
        launcher = start(tmp_path, *args, f"hydra.run.dir={run_dir}")
        wait_for(run_dir / "checkpoints" / "step_0000020")
        launcher.send_signal(sig)
        assert launcher.wait(timeout=120) == code
        saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
        assert saved and not any(p.endswith(".tmp") for p in saved)
        layout = json.loads((run_dir / "checkpoints" / saved[-1] / "MANIFEST.json").read_text())
        assert layout["layout"] == ("sharded" if mode == "fsdp" else "full")  # format: auto
        resumes = saved[-1]
        if sig == signal.SIGKILL and mode == "ddp":
            # Only rank 1 reads its RNG file: damaged, it fails there alone, and the
            # ranks agree on the newest checkpoint both verify (one plan, every rank).
            (run_dir / "checkpoints" / saved[-1] / "rng_rank1.pt").write_bytes(b"damaged")
            resumes = saved[-2]
        ok(run(tmp_path, *args, f"hydra.run.dir={run_dir}"))  # the same command again
        summary = json.loads((run_dir / "summary.json").read_text())
        assert Path(summary["resumed_from"]).name == resumes and summary["step"] == 60
        assert fingerprints(run_dir) == {"train.log": expected, "train_rank1.log": expected}


def _workers(launcher: subprocess.Popen) -> list[int]:
    """The pids of the worker processes the launcher spawned (multiprocessing spawn)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == launcher.pid and b"spawn_main" in cmdline:
            found.append(int(proc.name))
    return sorted(found)


def test_lean_ddp_step_skip_in_lockstep_and_a_signal_to_one_rank_stops_at_a_log_step(tmp_path):
    """Issue 18: no collective of its own per step. on_nan=skip: a NaN on rank 1
    only drops the update on both ranks (one all-reduce decides, and carries the
    stop flag). on_nan=stop: a SIGTERM reaching one worker only is agreed on at
    the next log step (every 5 here), where every rank saves and exits 143."""
    skip = tmp_path / "skip"
    args = ["parallel=ddp", "preflight=off", "tracker=none", "trainer.log_every_n_steps=5"]
    ok(
        run(
            tmp_path,
            *args,
            "model._target_=engine_tests.faults.NanOnRank1",
            "trainer.on_nan=skip",
            "trainer.max_steps=10",
            f"hydra.run.dir={skip}",
        )
    )
    assert json.loads((skip / "summary.json").read_text())["skipped_nan_steps"] == 2
    assert_two_rank_run(skip)  # the same weights on both ranks: the same decisions

    stopped = tmp_path / "stopped"
    launcher = start(
        tmp_path,
        *args,
        "model._target_=engine_tests.faults.Slow",
        "trainer.max_steps=400",
        "checkpoint.every_n_steps=1000",
        f"hydra.run.dir={stopped}",
    )
    log_file = stopped / "train.log"
    deadline = time.monotonic() + 120
    while "step 10/400" not in (log_file.read_text() if log_file.exists() else ""):
        assert time.monotonic() < deadline and launcher.poll() is None
        time.sleep(0.05)
    logged = [int(m) for m in re.findall(r"step (\d+)/400", log_file.read_text())]
    workers = _workers(launcher)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGTERM)  # one rank only
    assert launcher.wait(timeout=120) == 143
    latest = json.loads((stopped / "checkpoints" / "latest.json").read_text())["path"]
    manifest = json.loads((stopped / "checkpoints" / latest / "MANIFEST.json").read_text())
    assert manifest["reasons"] == ["signal"] and manifest["step"] % 5 == 0
    # Signalled at step >= the last logged one: stopped within 5 steps of it, or 10
    # when the signal landed just after a log step's agreement.
    assert max(logged) < manifest["step"] <= max(logged) + 10, (logged, manifest["step"])


def test_a_nan_on_one_rank_stops_both_at_the_log_step_with_its_window_logged(tmp_path):
    """on_nan=stop under DDP: the log window's sums ride in the agreement's collective.
    A NaN loss on rank 1 only (steps 3 and 4) is agreed on at the log step (5): both
    ranks exit 3 naming step 3, and that window's mean is logged before the stop (NaN:
    one rank's sum is)."""
    run_dir = tmp_path / "nan"
    proc = run(
        tmp_path,
        "parallel=ddp",
        "preflight=off",
        "tracker=csv",
        "trainer.log_every_n_steps=5",
        "trainer.max_steps=20",
        "model._target_=engine_tests.faults.NanOnRank1",
        f"hydra.run.dir={run_dir}",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-5000:]
    assert "not finite (NaN/inf) at step 3" in out and "Traceback" not in out
    losses = train_losses(run_dir)
    assert sorted(losses) == [5], losses
    assert losses[5] != losses[5]  # NaN: rank 1's window held it
