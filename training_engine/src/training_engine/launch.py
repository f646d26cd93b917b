"""Decide how the processes of a run come to be, and start them when we must.

- Inside a launcher (``torchrun``, ``accelerate launch``, or our own spawn):
  the launcher made the processes; run here, once per process.
- Inside a SLURM job step with several tasks (``hydra/launcher=slurm``, whose
  submitit runs every task through ``srun``, or your own ``srun python
  train.py``): SLURM made the processes. Their ranks, world size and
  rendezvous come from SLURM's environment (submitit's
  ``TorchDistributedEnvironment``); run here, never spawn again.
- In a pod of Kubeflow Trainer's torch runtime (``hydra/launcher=k8s``): the
  runtime sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
  ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``, which ``torchrun`` reads as
  its defaults; ``adopt_pet_env`` makes them the ``parallel`` keys, so
  ``python train.py`` starts the same node's workers as ``torchrun`` would.
- ``parallel=none``, or a world of one process: run here.
- Otherwise (``python train.py parallel=ddp``): start ``num_processes`` workers
  on this node with torch's elastic launcher, the engine ``torchrun`` runs.
  The parent has already composed and resolved the config and created the run
  directory; workers receive both and never re-enter ``@hydra.main``.
  Multi-node is the same rendezvous with ``num_nodes``, ``node_rank`` and
  ``master_addr:master_port``: run the same command on every node.

A failing rank makes the whole run fail with that rank's traceback; workers
die with their launcher, even when it is killed with SIGKILL.
"""

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from . import recovery
from .config import ConfigError
from .entry import freeze_what_is_imported, skip_the_final_collection
from .trust import literal

log = logging.getLogger(__name__)

# Set by every launcher we support for each process it starts.
LAUNCHER_ENV = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")


class LaunchError(RuntimeError):
    """A worker failed, or the processes do not match what was asked for."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def under_launcher() -> bool:
    return any(var in os.environ for var in LAUNCHER_ENV)


def global_rank() -> int:
    """This process's rank, known before any process group exists."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def processes_per_node(parallel: DictConfig) -> int:
    """``num_processes``, with ``auto`` = visible GPUs, else ``cpu_processes``."""
    if parallel.mode == "none":
        return 1
    if parallel.num_processes == "auto":
        return torch.cuda.device_count() or parallel.cpu_processes
    return int(parallel.num_processes)


def expected_world_size(parallel: DictConfig) -> int:
    if under_launcher():
        return int(os.environ.get("WORLD_SIZE", "1"))
    return processes_per_node(parallel) * (1 if parallel.mode == "none" else parallel.num_nodes)


def spans_nodes(parallel: DictConfig) -> bool:
    """True when this run's processes are on more than one machine (outside
    SLURM, whose job id names the run the same on every node)."""
    if "SLURM_JOB_ID" in os.environ:
        return False
    if under_launcher():
        return int(os.environ.get("WORLD_SIZE", "1")) > int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return parallel.mode != "none" and parallel.num_nodes > 1


def runs_alone(parallel: DictConfig) -> bool:
    """True when this process is the whole run, or starts all of its processes itself
    (no other launcher, node or SLURM task takes part)."""
    return not under_launcher() and slurm_task_count() < 2 and not spans_nodes(parallel)


def slurm_task_count() -> int:
    """Tasks in the SLURM job step this process belongs to; 0 outside one.
    (A batch script is not a step: ``python train.py`` in it is one process.)"""
    if "SLURM_STEP_ID" not in os.environ:
        return 0
    return int(os.environ.get("SLURM_STEP_NUM_TASKS", os.environ.get("SLURM_NTASKS", "1")))


def adopt_slurm_ranks() -> None:
    """In a multi-task SLURM step, export RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR (the job's first node) and MASTER_PORT (from the job id, or
    ``MASTER_PORT`` if set) so the tasks form one process group."""
    if under_launcher() or slurm_task_count() < 2:
        return
    try:
        from submitit.helpers import TorchDistributedEnvironment
    except ImportError:
        raise LaunchError(
            f"this is one of {slurm_task_count()} SLURM tasks; reading their ranks needs "
            "submitit: pip install -e '.[slurm]'"
        ) from None
    # submitit recognises SLURM by this variable, which its own jobs set and a
    # plain `srun python train.py` does not; the SLURM variables are there either way.
    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")
    # Keep every GPU visible: accelerate picks cuda:LOCAL_RANK itself.
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


# The torchrun contract of Kubeflow Trainer's torch runtime (pkg/constants/constants.go):
# the parallel key each variable stands for, and what torchrun accepts in it.
PET_KEYS = {
    "PET_NNODES": ("num_nodes", "an integer >= 1"),
    "PET_NPROC_PER_NODE": ("num_processes", "auto or an integer >= 1"),
    "PET_NODE_RANK": ("node_rank", "an integer >= 0"),
    "PET_MASTER_ADDR": ("master_addr", "a host name or address"),
    "PET_MASTER_PORT": ("master_port", "a port number in 1..65535"),
}


def _pet_value(key: str, text: str) -> Any:
    """The value of one PET_* variable for its parallel key; None if not allowed."""
    if key == "master_addr":
        return text or None
    if key == "num_processes" and text == "auto":
        return text
    if not text.isdigit():
        return None
    number = int(text)
    low, high = {"node_rank": (0, None), "master_port": (1, 65535)}.get(key, (1, None))
    return number if number >= low and (high is None or number <= high) else None


def adopt_pet_env(parallel: DictConfig, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Set the ``parallel`` keys from the ``PET_*`` variables in ``env``, the way
    ``torchrun`` takes its flags' defaults from them; returns what was set. Call
    it before the keys are used (node 0's main process owns the run dir). A
    value torchrun would not take, or more processes than ``parallel=none``
    runs, stops the run (exit code 2)."""
    raw = {var: env[var] for var in PET_KEYS if var in env}
    values: dict[str, Any] = {}
    for var, text in raw.items():
        key, expected = PET_KEYS[var]
        values[key] = _pet_value(key, text)
        if values[key] is None:
            raise ConfigError(f"{var}={text!r} is not allowed: expected {expected}")
    if not values:
        return {}
    if parallel.mode == "none":  # one process: nothing to adopt, nothing to contradict
        if values.get("num_nodes", 1) > 1 or values.get("num_processes", 1) not in (1, "auto"):
            asked = " ".join(f"{var}={text}" for var, text in raw.items())
            raise ConfigError(
                f"parallel=none runs one process, but the environment asks for more ({asked}): "
                "use parallel=ddp, fsdp or deepspeed"
            )
        return {}
    for key, value in values.items():
        parallel[key] = value
    if env is os.environ and int(env.get("LOCAL_RANK", "0")) == 0:  # this process's, once a node
        log.info(
            "rendezvous from the PET_* environment (Kubeflow Trainer, torchrun): "
            + " ".join(f"parallel.{key}={value}" for key, value in values.items())
        )
    return values


def run(fn: Callable[[DictConfig, Path], Any], cfg: DictConfig, run_dir: Path) -> Any:
    """``fn(cfg, run_dir)`` on every process the config asks for; rank 0's result."""
    adopt_slurm_ranks()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun (and accelerate launch, which runs it) starts each worker in a
        # session of its own: without this, a killed torchrun leaves its workers
        # training with the other nodes' (the self-spawned workers do it in _worker).
        _die_with_parent()
    if under_launcher() or expected_world_size(cfg.parallel) == 1:
        return fn(cfg, run_dir)
    if slurm_task_count() == 1:
        log.warning(
            "one SLURM task is starting all the processes itself: give the job one task per "
            "process (hydra.launcher.tasks_per_node) so that SLURM signals reach every rank"
        )
    return _spawn(fn, cfg, run_dir)


def _spawn(fn: Callable[[DictConfig, Path], Any], cfg: DictConfig, run_dir: Path) -> Any:
    # Imported here: only a self-launching parent needs the elastic machinery.
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    p = cfg.parallel
    nproc = processes_per_node(p)
    elastic_logs = tempfile.mkdtemp(prefix="torchelastic-")
    if p.num_nodes == 1:
        # c10d on port 0 picks a free port: concurrent runs never clash.
        port = p.master_port or 0
        rdzv = {"rdzv_backend": "c10d", "rdzv_endpoint": f"localhost:{port}", "rdzv_configs": {}}
    else:
        # static: node_rank decides the rank order, as torchrun --node-rank does.
        rdzv = {
            "rdzv_backend": "static",
            "rdzv_endpoint": f"{p.master_addr}:{p.master_port}",
            "rdzv_configs": {"rank": p.node_rank},
        }
    no_gpus = p.num_processes == "auto" and not torch.cuda.device_count()
    log.info(
        f"starting {nproc} {p.mode} workers on node {p.node_rank} of {p.num_nodes} "
        f"({nproc * p.num_nodes} processes in all)"
        + (" on the CPU: no GPU visible (parallel.cpu_processes)" if no_gpus else "")
    )
    container = OmegaConf.to_container(cfg, resolve=True)
    # The agent logs each worker exit with a traceback of its own internals;
    # the LaunchError below reports the failing rank's own error instead.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # In-job recovery (docs/recovery.md): a failed group is started again, and resumes
    # from the last verified checkpoint, up to parallel.max_restarts times. The loop is
    # ours rather than the agent's own max_restarts: the agent restarts on any exit,
    # a deliberate stop (SIGTERM: saved, exit 143) and a bad config included, and
    # tells no one which rank failed and how; here both are known between attempts.
    max_restarts = p.max_restarts
    main = p.node_rank == 0  # node 0's launcher writes the run dir's notes
    try:
        for number in range(max_restarts + 1):
            config = LaunchConfig(
                min_nodes=p.num_nodes,
                max_nodes=p.num_nodes,
                nproc_per_node=nproc,
                # Every node must present the same id (the static store is keyed by it).
                run_id=uuid.uuid4().hex
                if p.num_nodes == 1
                else f"{cfg.project}-{p.master_port}-{number}",
                max_restarts=0,  # restarts: the loop around this launch
                start_method="spawn",
                monitor_interval=0.1,
                # The workers' error files go to a folder of the launch's own, not the run
                # dir: a launch that fails before its first step must leave a new run dir empty.
                logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(dir=elastic_logs)),
                **rdzv,
            )
            if main:
                recovery.clear_failure(run_dir, number)
            try:
                results = elastic_launch(config, _worker)(fn, container, str(run_dir), number)
                return results[min(results)]
            except ChildFailedError as err:
                rank, failure = _first_failure(err)
                code = recovery.exit_status(failure.exitcode)
                message = _failure_message(rank, failure)
                why = recovery.not_restartable(failure.exitcode, run_dir, number, message)
                again = number < max_restarts and why is None
                if main:
                    recovery.note_failure(
                        run_dir, number, rank=rank, exit_code=failure.exitcode, message=message
                    )
                if not again:
                    trained = why is None or not why.startswith("the attempt failed before")
                    if main and max_restarts and trained:  # the history, and why it ends
                        recovery.write_failed_summary(run_dir, number, message, why)
                    raise LaunchError(message, code) from None
                log.warning(
                    f"{message.splitlines()[0][:300]}\nattempt {number} failed: restarting the "
                    f"group from the last checkpoint (restart {number + 1} of {max_restarts})"
                )
    except SignalException as err:
        # The agent passed the signal on to the workers and waited for them: with
        # checkpoint.save_on_signal they saved at a step boundary before exiting.
        raise LaunchError(
            f"stopped by {err.sigval.name}: the workers were told to stop; restart the same "
            "command to resume",
            128 + err.sigval,
        ) from None
    finally:
        shutil.rmtree(elastic_logs, ignore_errors=True)
    raise AssertionError("unreachable")  # the loop returns or raises


STACK_LINES = 12  # of the first failing rank's traceback, in the console and train.log


# A collective's error on the rank whose peer went away first: a consequence.
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "remote process exited")


def _first_failure(err: Any) -> tuple[int, Any]:
    """The rank whose failure is the cause: one that found a hang (its message names
    the ranks that stopped; the stopped one it then SIGKILLed, rank 0 included, is its
    consequence), else one that did not fail for a lost peer (``LOST_PEER``: rank 0's
    collective after rank 1's exception, stamped the same second or, across a second's
    boundary, the one before: elastic's timestamps are whole seconds), the earliest
    and, among ties, one killed by a signal, before the ranks that then failed
    waiting for it."""
    from .watchdog import EXIT_HANG

    def order(item: tuple[int, Any]) -> tuple:
        rank, failure = item
        hang, signal = failure.exitcode == EXIT_HANG, failure.exitcode < 0
        return (not hang, _lost_a_peer(failure), failure.timestamp, not signal, rank)

    return min(_recorded_failures(err).items(), key=order)


def _recorded_failures(err: Any) -> dict[int, Any]:
    """``err.failures`` and, when each of them is a lost peer, the error each other
    rank of this node recorded in its file (record() writes every exception, known
    stops too). The agent lists only the ranks that had exited when it looked; a rank
    that raised, recorded it and is still closing its process group may not have,
    while the peer that its closing made fail at once has (the cause unlisted: seen in
    a test, about 1 run in 2)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = dict(err.failures)
    if not all(_lost_a_peer(failure) for failure in failures.values()):
        return failures  # a cause is listed
    for rank, failure in err.failures.items():
        attempt = Path(failure.error_file).parent.parent  # <attempt>/<local rank>/error.json
        if not Path(failure.error_file).is_file():
            continue
        for folder in attempt.iterdir():
            error_file = folder / "error.json"
            if not (folder.name.isdigit() and error_file.is_file()):
                continue
            other = rank - failure.local_rank + int(folder.name)
            if other in failures:
                continue
            with contextlib.suppress(Exception):  # unreadable: not a failure to name
                failures[other] = ProcessFailure(
                    local_rank=int(folder.name), pid=0, exitcode=1, error_file=str(error_file)
                )
    return failures


def _lost_a_peer(failure: Any) -> bool:
    details = failure.message  # a dict from record()'s error file, else a string
    text = str(details.get("message", "")) if isinstance(details, dict) else str(details)
    return any(sign in text for sign in LOST_PEER)


def _failure_message(rank: int, failure: Any) -> str:
    """The first failing rank's real error: its exception (type and message) first,
    then the last lines of its stack; one line for a known stop or a signal."""
    code = recovery.exit_status(failure.exitcode)
    details = failure.message  # a dict from record()'s error file, else a string
    cause = recovery.cause_of(failure.exitcode)
    if isinstance(details, dict):  # a traceback for crashes, one line for known stops
        error = str(details.get("message", "")).strip()
        trace = str(details.get("extraInfo", {}).get("py_callstack") or "").strip()
        if code == 1 and trace:
            last = trace.splitlines()[-STACK_LINES:]
            head = f"rank {rank} failed first ({cause}): {error or last[-1]}"
            return f"{head}\nTraceback (its last {len(last)} lines):\n" + "\n".join(last)
        details = error
    status = cause if cause == f"exit code {code}" else f"{cause}, exit code {code}"
    return f"rank {rank} failed first ({status}): {details}"


def _worker(
    fn: Callable[[DictConfig, Path], Any], container: dict, run_dir: str, number: int = 0
) -> Any:
    """Entry point of a spawned worker: the resolved config, never Hydra again;
    ``number``: the attempt (0, then one more per in-job restart)."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

    _die_with_parent()
    freeze_what_is_imported()  # its imports, done while unpickling fn
    skip_the_final_collection()
    os.environ["TRAIN_ATTEMPT"] = str(number)  # watchdog.attempt()
    cfg = OmegaConf.create(literal(container))  # resolved already: a ``${`` left is text
    OmegaConf.set_struct(cfg, True)
    try:
        # record() writes the error where the launcher reads it for the report.
        return record(fn)(cfg, Path(run_dir))
    except Exception as err:
        # Known stops (bad config, interrupted, ...) carry their exit code.
        if not hasattr(err, "exit_code"):
            raise
        log.error(str(err))
        if err.exit_code == 1:  # a failure: its message is the launcher's report of it
            ErrorHandler().record_exception(err)
        close_process_group()
        sys.exit(err.exit_code)


def close_process_group() -> None:
    """End this process's process group before a known stop exits. The exit freezes
    what is alive (entry.skip_the_final_collection), so a group left open is torn down
    by C++ exit handlers instead, with its threads still joinable: on the rank that
    hosts the TCPStore that aborted the process ("terminate called without an active
    exception", SIGABRT 134 instead of exit 2), once in a CI replay."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its launcher dies, even by SIGKILL."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher was already gone before prctl
        os._exit(1)
