"""One decision per launch about the run directory, made by the launch's main process
and shared by every process on every node (docs/trust.md).

- ``claim`` (the main process, before anything is written): lock the directory and
  decide whether it is new, this run (continue it), a finished run (report it,
  change nothing) or another run's (refuse: RunDirError, exit 2). Finished means
  ``summary.json`` and the final weights it records, verified: a summary without
  them is an end cut short, which the run completes from its last checkpoint. The attempt's
  statement of what the run is (``.hydra/``, ``config.yaml``, ``config.json``) is
  staged in ``.attempt/`` and takes its place only when training starts
  (``commit_attempt``): an attempt that fails before its first step leaves the run
  dir saying what it said before (a new run dir is removed whole).
- ``agree`` (every rank, a collective, once the processes are connected): every rank
  takes the main process's decision, and a process launched with another config
  or run dir than the main one's stops all of them at once with one clear error,
  instead of a node deciding on its own and leaving the others at a rendezvous.

The other processes of a launch (torchrun's ranks, SLURM tasks, the other nodes'
launchers) never look at the directory themselves.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from . import moments, trust
from .checkpoint import final_weights_problem
from .checkpoint.format import MODEL
from .config import ConfigError, allowed_config_changes, config_differences
from .files import temporary, write_atomic, write_json_atomic
from .logs import discard_run_logs, open_run_logs
from .run_dir import (
    SHARED_CHECK,
    RunDirError,
    is_launch_main,
    made_by_this_launch,
    save_hydra_files,
)

# What an attempt that failed before its first step leaves for you to read (its log,
# its preflight report), and what a job that failed leaves in a sweep (the sweep
# summary's record of it): a directory holding only these still counts as new.
DIAGNOSTICS = ("train.log", "train_rank*.log", "preflight.json")
LEFT_BY_A_FAILED_START = (".hydra", "job_status.json", *DIAGNOSTICS)
ATTEMPT = ".attempt"  # the staged statement of an attempt that has not started training
# Keys in which the processes of one launch may differ: per node, per mount, and the
# run dir's name (compared as the run dir itself; hydra.run.dir may have set it).
PER_NODE_KEYS = ("parallel.node_rank", "parallel.master_addr", "runs_root", "run_name")
SUMMARY = "summary.json"  # a finished run's commit record, written after its weights
# What a launch killed half-way leaves in the run dir besides its .tmp files (removed
# where they are made: a checkpoint's by CheckpointManager, the end's by reopen_the_end):
# preflight's scratch folder (preflight/checks.py SCRATCH) and the storage check's marker
LEFTOVERS = (".preflight", f"{SHARED_CHECK}*")

log = logging.getLogger(__name__)


@dataclass
class Decision:
    """What the main process decided, as plain data every rank receives (``agree``).
    ``kind``: new | continue | finished."""

    kind: str
    summary: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.kind == "finished"


@dataclass
class Claim:
    """The main process's claim (``decision``), or a no-op on the other processes."""

    run_dir: Path
    decision: Decision | None  # None: not the launch's main process
    lock_fd: int | None = field(default=None, repr=False)
    before: set[str] = field(default_factory=set, repr=False)  # entries before the claim


def inspect(run_dir: Path, cfg: DictConfig) -> Decision:
    """Read-only: what ``run_dir`` is to this config. Raises RunDirError for another
    run's directory. Only the launch's main process asks (module docstring)."""
    current = OmegaConf.to_container(cfg, resolve=True)
    if not (run_dir / "config.json").is_file():
        staged = _read(run_dir / ATTEMPT / "config.json")
        if not _holds_files(run_dir):
            return Decision("new")
        if staged is not None and not _differences(staged, current):
            return Decision("new")  # an attempt of this config killed before its first step
        found = ", ".join(sorted(p.name for p in run_dir.iterdir() if p.name != ATTEMPT)[:5])
        raise RunDirError(
            f"{run_dir} is not empty ({found}) but holds no run of this project "
            "(no config.json): a new run does not write into it. Use another run_name "
            "(or hydra.run.dir), or empty the directory"
        )
    saved = _read(run_dir / "config.json")
    if saved is None:
        raise RunDirError(
            f"{run_dir / 'config.json'} is not a config this project wrote (not JSON, or "
            "too large or deep): use another run_name, or repair it"
        )
    diffs = _differences(saved, current)
    if diffs:
        raise RunDirError(
            f"{run_dir} holds another run (its config differs in "
            + "; ".join(diffs[:6])
            + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
            + "): a new run does not write into it. Use another run_name (or hydra.run.dir) "
            "for a new run, or put those keys back to continue that one"
        )
    if cfg.checkpoint.resume == "never":
        raise RunDirError(
            f"checkpoint.resume=never, but {run_dir} already holds a run of this config: "
            "starting over in it would mix two runs. Use another run_name (or hydra.run.dir), "
            "or resume=auto to continue it"
        )
    summary = _read(run_dir / SUMMARY)
    if not _is_summary(summary):
        return Decision("continue")
    length = ("max_steps", "max_epochs")
    saved_trainer = saved.get("trainer") if isinstance(saved.get("trainer"), dict) else {}
    if all(saved_trainer.get(k) == current["trainer"].get(k) for k in length):
        problem = final_weights_problem(run_dir, summary.get("final_weights"))
        if problem is None:
            return Decision("finished", summary)
        log.warning(_cut_short(problem, checkpoints=cfg.checkpoint.enabled))
        return Decision("continue")
    if not (cfg.checkpoint.enabled and (run_dir / "checkpoints").is_dir()):
        raise RunDirError(
            f"{run_dir} holds a finished run without checkpoints (checkpoint=none), so it "
            "cannot continue to the new trainer.max_steps/max_epochs: use another run_name"
        )
    return Decision("continue", summary)


def _cut_short(problem: str, *, checkpoints: bool) -> str:
    """What a rerun does with a summary.json whose final weights do not verify."""
    said = f"summary.json says the run finished, but {problem}: its end was cut short. "
    if checkpoints:
        return (
            said + "It is completed from the last checkpoint (training resumes there, with "
            "nothing left to train when it is the final step) and writes model.safetensors, "
            "then summary.json"
        )
    return (
        said + "checkpoint=none kept no checkpoint to complete it from: the run trains again "
        "from step 0 (the same config and seed) to write model.safetensors and summary.json"
    )


def _differences(saved: Any, current: dict) -> list[str]:
    if not isinstance(saved, dict):
        return ["config.json: not an object"]
    return config_differences(saved, current, allowed_config_changes(current))


def _read(path: Path) -> Any:
    try:
        return trust.read_json(path)
    except trust.Malformed:
        return None


def _is_summary(summary: Any) -> bool:
    best = summary.get("best") if isinstance(summary, dict) else None
    return isinstance(best, dict) and isinstance(summary.get("step"), int)


def _holds_files(run_dir: Path) -> bool:
    """Any file in it (empty folders, e.g. a mount point for checkpoints, what a
    failed start leaves in a sweep, and a stale staged attempt do not count)."""
    if not run_dir.is_dir():
        return False
    return any(
        p.is_file()
        for top in run_dir.iterdir()
        if not _matches(top.name, (*LEFT_BY_A_FAILED_START, ATTEMPT))
        for p in ([top] if not top.is_dir() else top.rglob("*"))
    )


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


@contextlib.contextmanager
def claim(run_dir: Path, cfg: DictConfig, raw: DictConfig | None = None) -> Iterator[Claim]:
    """Decide about ``run_dir`` before anything is written (module docstring).

    The launch's main process locks the directory for the whole launch, stages the
    attempt (new or continued run) and starts ``train.log``; a finished run is
    reported by the caller and nothing in it changes. When the body raises before
    the attempt was committed, everything the attempt made is taken back. The
    other processes of the launch get a claim that does nothing."""
    if not is_launch_main(cfg):
        discard_run_logs()  # their logs are train_rank<r>.log, opened by the ranks
        yield Claim(run_dir, None)
        return
    lock_fd = None
    made = None
    try:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock_fd = _lock(run_dir)
            before = {p.name for p in run_dir.iterdir()} - {ATTEMPT}
            decision = inspect(run_dir, cfg)
            shutil.rmtree(run_dir / ATTEMPT, ignore_errors=True)  # a killed attempt's
            if not decision.finished:
                remove_leftovers(run_dir)  # of a launch killed before it finished
                stage_attempt(cfg, run_dir, raw)
                open_run_logs()
                moments.reached("claim")
            else:
                discard_run_logs()  # a finished run's train.log stays as it was
        except OSError as err:  # read-only, not a directory, no space
            raise RunDirError(
                f"cannot use {run_dir} as the run dir: {err.strerror or err} "
                f"({err.filename or run_dir}). Give a writable runs_root (or hydra.run.dir)"
            ) from None
        made = Claim(run_dir, decision, lock_fd, before)
        yield made
    except BaseException as err:
        discard_run_logs()
        if made is not None:  # bad input leaves nothing; another failure, its diagnostics
            take_back(made, keep_diagnostics=getattr(err, "exit_code", 1) != 2)
        raise
    finally:
        if lock_fd is not None:
            _unlock(lock_fd)


def take_back(claimed: Claim, *, keep_diagnostics: bool = False) -> None:
    """The attempt failed before its first step: remove what it staged and, for a new
    run, every entry it made (the directory too, when this launch made it and nothing
    is left), but with ``keep_diagnostics`` its log and preflight report."""
    run_dir = claimed.run_dir
    if not (run_dir / ATTEMPT).exists():
        return  # committed: the run started, what it wrote is the run's
    shutil.rmtree(run_dir / ATTEMPT, ignore_errors=True)
    if claimed.decision is not None and claimed.decision.kind == "new":
        kept = DIAGNOSTICS if keep_diagnostics else ()
        for entry in run_dir.iterdir():
            if entry.name not in claimed.before and not _matches(entry.name, kept):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        made_by_this_launch(run_dir, remove=True)


def remove_leftovers(run_dir: Path) -> None:
    """What a launch killed before it finished left (LEFTOVERS): the lock is held, so
    no live launch is using them."""
    for entry in run_dir.iterdir():
        if _matches(entry.name, LEFTOVERS):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def stage_attempt(cfg: DictConfig, run_dir: Path, raw: DictConfig | None = None) -> None:
    """``.attempt/``: what ``commit_attempt`` puts in place when training starts:
    ``.hydra/`` (Hydra's own files: ``hydra.output_subdir: null`` keeps Hydra from
    writing them before the claim), ``config.yaml`` and ``config.json``."""
    staged = run_dir / ATTEMPT
    staged.mkdir()
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        save_hydra_files(staged, raw if raw is not None else cfg)
    write_atomic(staged / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    write_json_atomic(staged / "config.json", OmegaConf.to_container(cfg, resolve=True))


def reopen_the_end(run_dir: Path) -> None:
    """The run trains again, so it is not finished until its end commits a new summary:
    a summary.json that says finished goes (an extended run's, or one whose weights did
    not verify; a failed run's record stays), then what a killed end left half-written."""
    if _is_summary(_read(run_dir / SUMMARY)):
        (run_dir / SUMMARY).unlink()
    for name in (SUMMARY, MODEL):
        temporary(run_dir / name).unlink(missing_ok=True)


def commit_attempt(run_dir: Path, accelerator: Any) -> None:
    """Training starts: the staged files replace the run dir's (config.json last, so a
    crash in between leaves the old statement or the new one). The main process
    does it; a no-op when nothing is staged."""
    staged = run_dir / ATTEMPT
    if not accelerator.is_main_process or not staged.is_dir():
        return
    reopen_the_end(run_dir)
    files = sorted(
        (p for p in staged.rglob("*") if p.is_file()), key=lambda p: p.name == "config.json"
    )
    for path in files:
        target = run_dir / path.relative_to(staged)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(staged, ignore_errors=True)


# --- every rank takes the main process's decision ------------------------------------------


def agree(
    decision: Decision | None, *, cfg: DictConfig, run_dir: Path, accelerator: Any
) -> Decision:
    """The main process's decision, on every rank (a collective). Every rank sends its
    config and run dir; one that differs from the main process's (another node
    launched with other values) stops every rank with the same ConfigError (exit 2)."""
    mine = OmegaConf.to_container(cfg, resolve=True)
    if accelerator.num_processes == 1:
        return decision or Decision("new")
    from accelerate.utils import gather_object

    sent = gather_object([(accelerator.process_index, decision, str(run_dir), mine)])
    main_decision, main_dir, main_cfg = next((d, r, c) for _, d, r, c in sent if d is not None)
    problems = []
    for rank, _, other_dir, other in sent:
        diffs = config_differences(main_cfg, other, PER_NODE_KEYS)
        if diffs:
            problems.append(f"rank {rank}: {'; '.join(diffs[:4])}")
        elif Path(other_dir).name != Path(main_dir).name:
            problems.append(f"rank {rank}: run dir {other_dir} (the main process's: {main_dir})")
    if problems:
        accelerator.wait_for_everyone()  # leave together: a rank gone first aborts gloo's peers
        raise ConfigError(
            "the processes of this launch were started with other values than the main "
            "process's (every node must run the same command, only parallel.node_rank "
            "differs):\n  " + "\n  ".join(problems)
        )
    return main_decision


# --- the lock: one live launch per run dir -------------------------------------------------

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
