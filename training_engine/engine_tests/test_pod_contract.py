"""The pod contract of Kubeflow Trainer's torch runtime: the PET_* variables as
train.py reads them (training_engine/launch.py), and two "pods" emulated on this machine with
real torchrun processes: one run, SIGTERM, kill -9 of a whole pod, restarts."""

import contextlib
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
from omegaconf import OmegaConf

from hydra_plugins.training_engine_k8s import manifest
from training_engine.config import ConfigError
from training_engine.launch import adopt_pet_env
from training_engine.schema import Parallel

from .conftest import CONFIG_FILES, ENV, PROJECT_ROOT, fingerprints, wait_for
from .test_k8s import manifests, render

# --- PET_* in train.py (training_engine/launch.py) --------------------------------------------


def _parallel(mode: str = "ddp"):
    """The parallel group as ``parallel=ddp`` (or none) makes it: its preset over its
    schema (the preset sets only what differs from the schema's defaults)."""
    preset = OmegaConf.load(CONFIG_FILES["parallel", "ddp" if mode != "none" else "none"])
    preset.pop("defaults")
    cfg = OmegaConf.merge(OmegaConf.structured(Parallel), preset)
    cfg.mode = mode
    OmegaConf.set_struct(cfg, True)
    return cfg


def test_the_pet_variables_become_the_parallel_keys():
    parallel = _parallel()
    env = manifest.pod_env("job", num_nodes=2, procs_per_node=8, node_rank=1)
    adopted = adopt_pet_env(parallel, env=env)
    assert adopted == {
        "num_nodes": 2,
        "num_processes": 8,
        "node_rank": 1,
        "master_addr": "job-node-0-0.job",
        "master_port": 29400,
    }
    assert {k: parallel[k] for k in adopted} == adopted
    assert adopt_pet_env(parallel, env={"PET_NPROC_PER_NODE": "auto"}) == {"num_processes": "auto"}
    untouched = _parallel()
    assert adopt_pet_env(untouched, env={}) == {} and untouched == _parallel()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PET_NNODES": "1:4"}, "PET_NNODES='1:4' is not allowed: expected an integer >= 1"),
        (
            {"PET_NPROC_PER_NODE": "gpu"},
            "PET_NPROC_PER_NODE='gpu' is not allowed: expected auto or",
        ),
        ({"PET_NODE_RANK": "-1"}, "PET_NODE_RANK='-1' is not allowed"),
        ({"PET_MASTER_PORT": "70000"}, "PET_MASTER_PORT='70000' is not allowed: expected a port"),
        ({"PET_MASTER_ADDR": ""}, "PET_MASTER_ADDR='' is not allowed"),
    ],
)
def test_a_pet_value_torchrun_would_not_take_is_refused(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        adopt_pet_env(_parallel(), env=env)


def test_parallel_none_takes_one_process_pods_and_refuses_more():
    none = _parallel("none")
    assert adopt_pet_env(none, env={"PET_NNODES": "1", "PET_NPROC_PER_NODE": "1"}) == {}
    with pytest.raises(ConfigError, match="parallel=none runs one process"):
        adopt_pet_env(none, env={"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1"})


# --- the pod contract, emulated: two "pods" of two processes each -------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(proc.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it may have exited meanwhile
        os.kill(pid, sig)


# FSDP, as on a cluster; small and slow enough to be stopped mid-run (engine_tests.faults.Slow:
# 50 ms a step); a collective that waits for a dead pod fails within a minute, not 10.
# (Not DDP: with more than 2 ranks, a resumed DDP run's first step reduces in the bucket
# layout DDP has before its one-time rebuild, and its weights differ from an uninterrupted
# run's in the last bit.)
EMULATED = [
    "parallel=fsdp",
    "parallel.timeout_s=60",
    "model._target_=engine_tests.faults.Slow",
    "trainer.max_steps=100",
    "trainer.log_every_n_steps=10",
    "trainer.eval_every_n_steps=50",
    "checkpoint.every_n_steps=10",
    "tracker=csv",
    "preflight=off",
]


class Pods:
    """The pods of one rendered TrainJob on this machine, each running the manifest's
    command with the environment the torch runtime gives it (PET_*; the master is
    127.0.0.1 here) and the manifest's env. Each start's output: <logs>/pod<rank>-<n>.log."""

    def __init__(self, job: dict, runs: Path, port: int, logs: Path) -> None:
        trainer = job["spec"]["trainer"]
        self.command = [
            f"runs_root={runs}" if arg.startswith("runs_root=") else arg
            for arg in trainer["command"]
        ]
        self.command[0] = str(Path(sys.executable).parent / "torchrun")
        self.env = {**ENV, **{e["name"]: e["value"] for e in trainer["env"]}}
        self.contract = {
            "PET_NNODES": str(trainer["numNodes"]),
            "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port),
        }
        self.logs = logs
        self.starts = 0
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        """Every pod, as JobSet (re)creates them: the same command and environment."""
        self.starts += 1
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs = []
        for rank in range(int(self.contract["PET_NNODES"])):
            with open(self.logs / f"pod{rank}-{self.starts}.log", "w") as out:
                self.procs.append(
                    subprocess.Popen(
                        self.command,
                        cwd=PROJECT_ROOT,  # the image's WORKDIR
                        env={**self.env, **self.contract, "PET_NODE_RANK": str(rank)},
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )

    def wait(self, timeout: float = 180) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            codes = []
            for proc in self.procs:
                try:
                    codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    pytest.fail(f"the pods still run after {timeout:.0f}s:\n{self.report()}")
            return codes
        finally:
            self.kill()

    def report(self) -> str:
        """Each pod: its exit code, or its processes still there (state, where each
        waits in the kernel), and the end of its log: what a hang needs explained."""
        lines = []
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                lines.append(f"pod {rank}: exited {proc.returncode}")
            else:
                lines.append(f"pod {rank}: running")
                for pid in process_tree(proc.pid):
                    with contextlib.suppress(OSError):
                        proc_dir = Path("/proc") / str(pid)
                        state = (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[0]
                        wchan = (proc_dir / "wchan").read_text()
                        cmd = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ")[:120]
                        lines.append(f"  {pid} {state} {wchan}: {cmd.decode(errors='replace')}")
            lines.append(self.output(rank)[-1500:])
        return "\n".join(lines)

    def output(self, rank: int) -> str:
        return (self.logs / f"pod{rank}-{self.starts}.log").read_text()[-3000:]

    def terminate(self) -> None:
        """What the kubelet does first: SIGTERM to each container's main process."""
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)

    def kill(self, rank: int | None = None) -> None:
        """A pod dies whole: every process in it, frozen first so that none starts
        another. (torchrun starts its workers in sessions of their own: killing its
        process group would leave them training.)"""
        for i, proc in enumerate(self.procs):
            if rank not in (None, i) or proc.poll() is not None:
                continue
            frozen: set[int] = set()
            while new := set(process_tree(proc.pid)) - frozen:
                for pid in new:
                    _signal(pid, signal.SIGSTOP)
                frozen |= new
            for pid in frozen:
                _signal(pid, signal.SIGKILL)
            proc.wait()


def newest_checkpoint(run_dir: Path) -> str:
    return json.loads((run_dir / "checkpoints" / "latest.json").read_text())["path"]


@pytest.mark.multiprocess
def test_the_pod_contract_gives_one_run_that_survives_sigterm_and_a_killed_pod(tmp_path):
    """Two pods of two processes each, as the manifest says: one run dir, world size
    4. Then the same run stopped twice: SIGTERM to both pods (preemption: every rank
    saves, then exits), and later kill -9 of one whole pod (the other fails); after
    each, both pods start again with the same command, as JobSet restarts them. It
    ends with the weights of the uninterrupted run, bit for bit."""
    proc = render(tmp_path, *EMULATED, "parallel.num_nodes=2", "hydra.launcher.gpus_per_node=0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ((_, job),) = manifests(tmp_path).values()
    assert (job["spec"]["trainer"]["numNodes"], job["spec"]["trainer"]["numProcPerNode"]) == (2, 2)
    (run_name,) = [
        a.removeprefix("run_name=")
        for a in job["spec"]["trainer"]["command"]
        if a.startswith("run_name=")
    ]

    straight = Pods(job, tmp_path / "pvc-straight", free_port(), tmp_path / "logs-straight")
    straight.start()
    assert straight.wait() == [0, 0], straight.output(0)
    (summary,) = (tmp_path / "pvc-straight").rglob("summary.json")
    assert summary.parent == tmp_path / "pvc-straight" / run_name
    assert json.loads(summary.read_text())["world_size"] == 4
    expected = fingerprints(summary.parent)
    assert len(expected) == 4 and len(set(expected.values())) == 1, expected

    pods = Pods(job, tmp_path / "pvc", free_port(), tmp_path / "logs")
    run_dir = tmp_path / "pvc" / run_name
    pods.start()
    try:
        wait_for(run_dir / "checkpoints" / "step_0000020", timeout=150)
        pods.terminate()
        codes = [p.wait(timeout=120) for p in pods.procs]
    finally:
        pods.kill()
    assert all(code != 0 for code in codes), codes
    stopped_at = newest_checkpoint(run_dir)
    assert re.search(rf"{stopped_at} \(.*signal", (run_dir / "train.log").read_text())
    assert not (run_dir / "summary.json").exists()

    pods.start()
    try:
        wait_for(run_dir / "checkpoints" / "step_0000060", timeout=150)
        pods.kill(rank=1)
        assert pods.procs[0].wait(timeout=120) != 0  # its peers are gone
    finally:
        pods.kill()
    assert not (run_dir / "summary.json").exists()

    pods.start()
    assert pods.wait() == [0, 0], pods.output(0)
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["resumed_from"] and resumed["step"] == 100 and resumed["world_size"] == 4
    assert fingerprints(run_dir) == expected
