"""The run directory: Hydra's output dir, shared by every rank of a run.

It holds ``.hydra/``, the resolved ``config.yaml`` and ``config.json``,
``train.log``, ``metrics.csv``, ``checkpoints/`` and, at the end,
``summary.json`` and ``model.safetensors`` (docs/run-dir.md).

- The default name is unique per launch (start time plus a short id of the
  launching process), the same on every rank, and ``slurm-<job id>`` in SLURM
  (stable across a requeue). ``runs_root`` is absolute (the project root's
  ``runs/`` by default), so a command finds its run from any directory.
- ``run_name`` stays inside ``runs_root``; a launch stopped by bad input removes
  the folders made for it (``made_by_this_launch``).
- Whether the directory is new, this run, a finished run or another run's is
  decided once per launch by claim.py. Only the global main process writes here.
"""

import contextlib
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from accelerate import PartialState
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from . import moments
from .checkpoint.format import CheckpointError
from .config import ConfigError
from .files import fsync_dir, temporary, write_atomic, write_durable
from .launch import global_rank, under_launcher


class RunDirError(ConfigError):
    """The run directory belongs to another run, or is in use (exit code 2)."""


SHARED_CHECK = ".shared-check-"  # check_shared_storage's marker (a killed launch's: claim.py)


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


def hydra_run_dir_as_written() -> Path:
    """The run dir as the config wrote it (``..`` kept: Hydra made each folder on the way)."""
    hydra = HydraConfig.get()
    if hydra.mode == RunMode.MULTIRUN:
        return hydra_run_dir()
    return Path(hydra.run.dir)


def in_sweep() -> bool:
    """True inside a job of ``python train.py -m ...``."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def is_launch_main(cfg: DictConfig) -> bool:
    """The process that writes the run dir's shared files. No process group
    exists yet: the launcher's env (or node_rank when this process will spawn
    the workers of one node) says who it is."""
    return global_rank() == 0 and cfg.parallel.node_rank == 0


def uses_default_run_name(cfg: DictConfig) -> bool:
    """True when neither ``run_name`` nor ``hydra.run.dir`` was chosen by the user."""
    raw = OmegaConf.to_container(cfg, resolve=False).get("run_name")
    chose_dir = any(o.startswith("hydra.run.dir=") for o in HydraConfig.get().overrides.hydra)
    return raw == "${default_run_name:}" and not chose_dir and not in_sweep()


def check_run_name(cfg: DictConfig) -> None:
    """``run_name`` names a directory inside ``runs_root`` (ConfigError, exit 2,
    otherwise). ``hydra.run.dir`` may be anywhere: that is what it is for."""
    name = str(cfg.run_name)
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts or name.startswith("~"):
        raise ConfigError(
            f"run_name={name!r} is not allowed: expected a name inside runs_root "
            f"({cfg.runs_root}), e.g. run_name=exp1 or run_name=team/exp1 (no '..', not "
            "absolute; for a directory elsewhere use hydra.run.dir=DIR)"
        )


class NoteExistingFolders(Callback):
    """A Hydra callback (configs/train.yaml): before Hydra makes the run dir, note which
    folders on its way exist already, so that a launch stopped by bad input removes
    exactly the ones made for it (``made_by_this_launch``) and nothing else."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            path = Path(str(config.hydra.run.dir))
        except Exception:  # an interpolation that fails is reported by the run itself
            return
        _EXISTED.update(p for p in _on_the_way(path) if p.exists())
        _NOTED.append(path)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """The same for a sweep dir (a launcher that refuses bad input removes it)."""
        try:
            path = Path(str(config.hydra.sweep.dir))
        except Exception:
            return
        _EXISTED.update(p for p in _on_the_way(path) if p.exists())
        _NOTED.append(path)


_EXISTED: set[Path] = set()  # folders on the way to the run dir before Hydra made it
_NOTED: list[Path] = []  # the run dirs noted (none: remove nothing)


def _on_the_way(path: Path) -> list[Path]:
    """``path`` and its parents, each resolved, deepest first. ``..`` is kept as
    written until resolved: Hydra's mkdir of runs/a/../../x makes runs/a too."""
    lexical = Path.cwd() / path
    found = {Path(os.path.realpath(p)) for p in [lexical, *lexical.parents]}
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def made_by_this_launch(path: Path, *, remove: bool = False) -> list[Path]:
    """The folders on ``path``'s way (``path`` first, then its parents) that did not
    exist before Hydra made the run dir (``NoteExistingFolders``) and are empty now.
    With ``remove``, remove them: a launch stopped by bad input leaves nothing on disk."""
    if not _NOTED:
        return []  # not noted (the callback is off): never guess
    found = []
    for directory in _on_the_way(path):
        if directory in _EXISTED or not directory.is_dir() or any(directory.iterdir()):
            continue
        found.append(directory)
        if remove:
            with contextlib.suppress(OSError):
                directory.rmdir()
    return found


def save_hydra_files(run_dir: Path, task_cfg: DictConfig) -> None:
    """What Hydra writes to ``.hydra/``: the composed config (unresolved),
    Hydra's own config and the command line's overrides."""
    hydra_cfg = HydraConfig.get()
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(hydra_dir / "config.yaml", OmegaConf.to_yaml(task_cfg))
    hydra_yaml = OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg}))
    write_atomic(hydra_dir / "hydra.yaml", hydra_yaml)
    write_atomic(hydra_dir / "overrides.yaml", OmegaConf.to_yaml(hydra_cfg.overrides.task))


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
    marker = run_dir / f"{SHARED_CHECK}{token[0]}"
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
    """``summary.json``, atomically, by the main process: a finished run's commit
    record, written after every other file of the end (claim.py checks them)."""
    if PartialState().is_main_process:
        path = Path(run_dir) / "summary.json"
        try:
            write_durable(temporary(path), json.dumps(summary, indent=2) + "\n")
            moments.reached("summary")  # written, not yet in place: the run is not finished
            os.replace(temporary(path), path)
        except OSError:
            temporary(path).unlink(missing_ok=True)  # a full disk: nothing half-written left
            raise
        fsync_dir(path.parent)  # the commit: durable before the process reports done


def end_not_written(run_dir: Path, what: str, err: OSError) -> CheckpointError:
    """The error of an end of a run (``what``: the final weights, the trackers' files,
    summary.json) that the disk refused: which, why, what to do. Not retried
    (recovery.py: exit 1)."""
    from . import disk

    why = disk.full_disk_report(run_dir, None) if disk.is_full(err) else err.strerror or err
    return CheckpointError(
        f"could not write the end of the run in {run_dir} ({err.filename or what}): {why}. "
        "The checkpoints are intact, and the run is not finished: free space there (or fix "
        "its permissions), then run the same command: it completes the end from the last "
        "checkpoint"
    )
