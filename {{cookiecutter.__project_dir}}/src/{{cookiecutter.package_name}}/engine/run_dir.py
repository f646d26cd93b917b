"""The run directory: Hydra's output dir, shared by every rank of a run.

It holds ``.hydra/``, the resolved ``config.yaml`` and ``config.json``,
``train.log``, ``metrics.csv``, ``checkpoints/`` and, at the end,
``summary.json`` and ``model.safetensors`` (README: "The run directory").

- The default name is unique per launch (start time plus a short id of the
  launching process), the same on every rank, and ``slurm-<job id>`` in SLURM
  (stable across a requeue). ``runs_root`` is absolute (the project root's
  ``runs/`` by default), so a command finds its run from any directory.
- ``claim`` decides, before anything is written, whether the directory is
  new, this run (continue or resume it), a finished run (report, change
  nothing) or another run's (refuse). A directory in use by a live run is
  refused too (an flock on the directory, released when the process dies).
- Only the global main process writes here.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate import PartialState
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .config import ConfigError, allowed_config_changes, config_differences
from .launch import global_rank, under_launcher
from .logs import discard_run_logs, open_run_logs

# What a directory may hold and still count as new: what a job that failed its
# config checks leaves in a sweep (the sweep summary's record of it).
LEFT_BY_A_FAILED_START = {".hydra", "job_status.json"}


class RunDirError(ConfigError):
    """The run directory belongs to another run, or is in use (exit code 2)."""


# --- names -----------------------------------------------------------------------------


def _launcher_pid() -> int:
    """The process that launched this run: under torchrun/accelerate launch
    the parent of every local rank, else this process."""
    return os.getppid() if under_launcher() else os.getpid()


def launch_stamp() -> str:
    """``YYYY-MM-DD/HH-MM-SS-<id>``: the launcher's start time and a short id
    from its host, pid and start time, so launches in the same second differ
    and every local rank of one launch agrees."""
    pid = _launcher_pid()
    started = _process_start_time(pid) or time.time()
    ident = hashlib.sha1(f"{socket.gethostname()}:{pid}:{started}".encode()).hexdigest()[:6]
    return time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(started)) + f"-{ident}"


def default_run_name() -> str:
    """The default ``run_name``: the SLURM job id (the same on every task and
    after a requeue), else ``launch_stamp()``. (``${now:}`` would be resolved by
    each process of an external launcher at a slightly different time.)"""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if job:
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm-{job}" + (f"_{task}" if task and "SLURM_ARRAY_JOB_ID" in os.environ else "")
    return launch_stamp()


def _process_start_time(pid: int) -> float | None:
    """Seconds since the epoch when ``pid`` started (Linux /proc), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def hydra_run_dir() -> Path:
    """The output directory Hydra created for this job (run or multirun)."""
    return Path(HydraConfig.get().runtime.output_dir)


def write_text_atomic(path: Path, text: str) -> None:
    """Write a file so that readers see the old one or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def in_sweep() -> bool:
    """True inside a job of ``python train.py -m ...``."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def is_launch_main(cfg: DictConfig) -> bool:
    """The process that writes the run dir's shared files. No process group
    exists yet: the launcher's env (or node_rank when this process will spawn
    the workers of one node) says who it is."""
    return global_rank() == 0 and cfg.parallel.get("node_rank", 0) == 0


def uses_default_run_name(cfg: DictConfig) -> bool:
    """True when neither ``run_name`` nor ``hydra.run.dir`` was chosen by the user."""
    raw = OmegaConf.to_container(cfg, resolve=False).get("run_name")
    chose_dir = any(o.startswith("hydra.run.dir=") for o in HydraConfig.get().overrides.hydra)
    return raw == "${default_run_name:}" and not chose_dir and not in_sweep()


# --- claiming the directory ----------------------------------------------------------


@dataclass
class Claim:
    """What ``claim`` found. ``kind``: new | continue | finished."""

    run_dir: Path
    kind: str
    summary: dict[str, Any] | None = None
    lock_fd: int | None = field(default=None, repr=False)

    def discard(self) -> None:
        """The run failed before training started (e.g. a model that cannot be
        built): a directory this launch made is removed, nothing half-made stays."""
        if self.kind == "new" and self.lock_fd is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)


# What the launch's main process writes while it claims a new run dir, before
# config.json: another process of the launch may look in the middle of it.
CLAIM_FILES = {".hydra", "config.yaml", ".config.yaml.tmp", ".config.json.tmp", "train.log"}


def inspect(
    run_dir: Path, cfg: DictConfig, *, main: bool = True
) -> tuple[str, dict[str, Any] | None]:
    """Read-only: (kind, summary) of ``run_dir`` for this config. Raises
    RunDirError for another run's directory. Every launching process asks; the
    others (``main=False``) ask while the main process may be writing its claim,
    so they count what it writes as nothing (a new run) and leave the
    ``resume=never`` refusal to it (its config.json may be the one just written)."""
    if not _holds_files(run_dir):
        return "new", None
    saved_path = run_dir / "config.json"
    if not main and not saved_path.is_file() and {p.name for p in run_dir.iterdir()} <= CLAIM_FILES:
        return "new", None  # the main process is claiming it right now
    if not saved_path.is_file():
        found = ", ".join(sorted(p.name for p in run_dir.iterdir())[:5])
        raise RunDirError(
            f"{run_dir} is not empty ({found}) but holds no run of this project "
            "(no config.json): a new run does not write into it. Use another run_name "
            "(or hydra.run.dir), or empty the directory"
        )
    saved = json.loads(saved_path.read_text(encoding="utf-8"))
    current = OmegaConf.to_container(cfg, resolve=True)
    diffs = config_differences(saved, current, allowed_config_changes(current))
    if diffs:
        raise RunDirError(
            f"{run_dir} holds another run (its config differs in "
            + "; ".join(diffs[:6])
            + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
            + "): a new run does not write into it. Use another run_name (or hydra.run.dir) "
            "for a new run, or put those keys back to continue that one"
        )
    if main and cfg.checkpoint.get("resume") == "never":
        raise RunDirError(
            f"checkpoint.resume=never, but {run_dir} already holds a run of this config: "
            "starting over in it would mix two runs. Use another run_name (or hydra.run.dir), "
            "or resume=auto to continue it"
        )
    summary = _read_json(run_dir / "summary.json")
    if summary is None:
        return "continue", None
    length = ("max_steps", "max_epochs")
    same_length = all(saved["trainer"].get(k) == current["trainer"].get(k) for k in length)
    if same_length:
        return "finished", summary
    if not (cfg.checkpoint.get("enabled", False) and (run_dir / "checkpoints").is_dir()):
        raise RunDirError(
            f"{run_dir} holds a finished run without checkpoints (checkpoint=none), so it "
            "cannot continue to the new trainer.max_steps/max_epochs: use another run_name"
        )
    return "continue", summary


def _holds_files(run_dir: Path) -> bool:
    """Any file in it (empty folders, e.g. a mount point for checkpoints, and
    what a failed start leaves in a sweep do not count)."""
    if not run_dir.is_dir():
        return False
    return any(
        p.is_file()
        for top in run_dir.iterdir()
        if top.name not in LEFT_BY_A_FAILED_START
        for p in ([top] if not top.is_dir() else top.rglob("*"))
    )


@contextlib.contextmanager
def claim(run_dir: Path, cfg: DictConfig, raw: DictConfig | None = None) -> Iterator[Claim]:
    """Decide about ``run_dir`` before anything is written (module docstring).

    The launch's main process locks the directory for the whole run and, for a
    new or continued run, writes ``.hydra/``, ``config.yaml`` and ``config.json``
    and starts ``train.log``. A finished run is reported by the caller and
    nothing in it changes. Raises RunDirError (exit 2) otherwise."""
    main = is_launch_main(cfg)
    lock_fd = None
    try:
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock_fd = _lock(run_dir)
        kind, summary = inspect(run_dir, cfg, main=main)
        if main and kind != "finished":
            save_resolved_config(cfg, run_dir, raw)
            open_run_logs()
        else:
            discard_run_logs()  # a finished run's train.log stays as it was
        yield Claim(run_dir, kind, summary, lock_fd)
    except RunDirError:
        discard_run_logs()
        raise
    finally:
        if lock_fd is not None:
            _unlock(lock_fd)


# The lock fds this process holds. A forked child (a DataLoader worker) inherits
# them, and an flock lasts while any copy is open: after a kill -9 of the run,
# its orphaned workers (they notice within ~5 s) would keep the directory
# "in use" and refuse the resume. Forked children close their copies at once.
_HELD: set[int] = set()
_AT_FORK_REGISTERED = False


def _close_inherited_locks() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


def _lock(run_dir: Path) -> int:
    """An exclusive flock on the directory itself (no file added to it),
    held until the process ends; another live launch of the same dir is refused."""
    global _AT_FORK_REGISTERED
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirError(
            f"{run_dir} is in use by another training process right now: wait for it, "
            "or use another run_name (or hydra.run.dir)"
        ) from None
    if not _AT_FORK_REGISTERED:  # once per process (a hook cannot be unregistered)
        os.register_at_fork(after_in_child=_close_inherited_locks)
        _AT_FORK_REGISTERED = True
    _HELD.add(fd)
    return fd


def _unlock(fd: int) -> None:
    _HELD.discard(fd)
    os.close(fd)  # releases the flock


def save_resolved_config(cfg: DictConfig, run_dir: Path, raw: DictConfig | None = None) -> None:
    """``.hydra/`` (Hydra's own files: ``hydra.output_subdir: null`` keeps Hydra
    from writing them before the claim), ``config.yaml`` and ``config.json``."""
    if HydraConfig.initialized():
        save_hydra_files(run_dir, raw if raw is not None else cfg)
    write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    write_json_atomic(run_dir / "config.json", OmegaConf.to_container(cfg, resolve=True))


def save_hydra_files(run_dir: Path, task_cfg: DictConfig) -> None:
    """What Hydra writes to ``.hydra/``: the composed config (unresolved),
    Hydra's own config and the command line's overrides."""
    hydra_cfg = HydraConfig.get()
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(hydra_dir / "config.yaml", OmegaConf.to_yaml(task_cfg))
    hydra_yaml = OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg}))
    write_text_atomic(hydra_dir / "hydra.yaml", hydra_yaml)
    write_text_atomic(hydra_dir / "overrides.yaml", OmegaConf.to_yaml(hydra_cfg.overrides.task))


def check_shared_storage(run_dir: Path, accelerator: Any) -> None:
    """Every rank must see the run dir the main process writes (checkpoints are
    written by all ranks into one folder that the main process commits). The
    main process writes a marker, every rank looks for it; if any cannot see
    it (node-local storage, or each node given its own directory) every rank
    stops here with the reason. A collective: call on every rank."""
    if accelerator.num_processes == 1:
        return
    from accelerate.utils import broadcast_object_list, gather_object

    token = [os.urandom(8).hex() if accelerator.is_main_process else None]
    broadcast_object_list(token)
    marker = run_dir / f".shared-check-{token[0]}"
    if accelerator.is_main_process:
        marker.write_text(socket.gethostname())
    accelerator.wait_for_everyone()
    seen = gather_object([(accelerator.process_index, socket.gethostname(), marker.exists())])
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        marker.unlink(missing_ok=True)
    blind = [f"rank {rank} on {host}" for rank, host, ok in seen if not ok]
    if blind:
        raise RunDirError(
            f"the run directory is not shared by every process: {', '.join(blind)} cannot "
            f"see {run_dir}/ as the main process ({seen[0][1]}) writes it. Checkpoints need one "
            "directory that every node reads and writes: put the runs on shared storage "
            "(NFS, Lustre, ...) and give every node the same run_name (or hydra.run.dir)"
        )


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    if PartialState().is_main_process:
        write_json_atomic(run_dir / "summary.json", summary)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
