"""The training side of an Optuna sweep (``-m hparams_search=optuna``): report
each evaluation of ``trainer.monitor`` to this job's trial and stop the run when
the study's pruner prunes it.

The sweeper (``src/hydra_plugins/*_optuna/sweeper.py``) gives every job the
key ``optuna_trial`` (storage URL, study name, trial number); this module opens
that trial through the storage. Only the main process talks to the storage;
the decision is broadcast, so every rank stops at the same step. A pruned run
raises :class:`TrialPruned` (exit code 4) after its checkpoints of that step are
saved; the sweeper records the trial as PRUNED. Outside an Optuna sweep the
reporter does nothing and optuna need not be installed. See docs/sweeps.md.
"""

import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

EXIT_PRUNED = 4


class TrialPruned(RuntimeError):
    """The study's pruner stopped this trial; its checkpoints are kept."""

    exit_code = EXIT_PRUNED
    trial_state = "PRUNED"


def is_pruned(error: BaseException | None) -> bool:
    """True for a job stopped by the pruner, also when it ran in spawned workers
    (their launcher reports the exit code)."""
    return getattr(error, "exit_code", None) == EXIT_PRUNED


def open_storage(url: str) -> Any:
    """An Optuna RDB storage for ``url`` (sqlite waits for locks instead of failing
    when parallel trials write at once)."""
    import optuna

    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
    return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)


class TrialReporter:
    """``report_and_check(step, book)`` at every step boundary, on every rank."""

    def __init__(self, trial: Any, *, enabled: bool, accelerator: Any) -> None:
        self.trial = trial  # an optuna.trial.Trial on the main process, else None
        self.enabled = enabled  # the same on every rank: they all join the broadcast
        self.accelerator = accelerator

    @classmethod
    def from_config(cls, section: Any, *, accelerator: Any, run_dir: Path) -> "TrialReporter":
        """``section`` is the ``optuna_trial`` config (None outside an Optuna sweep)."""
        if section is None or section.get("number") is None:
            return cls(None, enabled=False, accelerator=accelerator)
        trial = None
        if accelerator.is_main_process:
            trial = _open_trial(section.storage, section.study_name, int(section.number))
            trial.set_user_attr("run_dir", str(run_dir))
            log.info(f"Optuna trial {section.number} of study {section.study_name!r}")
        return cls(trial, enabled=True, accelerator=accelerator)

    def report_and_check(self, step: int, book: Any) -> None:
        """After an evaluation at ``step``: report ``book.monitor``'s value to the
        trial and raise TrialPruned when the pruner says so (the same decision on
        every rank). At other steps: nothing."""
        if not self.enabled or book.last_step.get(book.monitor) != step:
            return
        prune = False
        if self.trial is not None:
            value = float(book.last[book.monitor])
            self.trial.report(value, step)
            prune = self.trial.should_prune()
            if prune:
                self.trial.set_user_attr("pruned_at_step", step)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast

            flag = torch.tensor([int(prune)], device=self.accelerator.device)
            prune = bool(broadcast(flag, from_process=0).item())
        if prune:
            value = book.last[book.monitor]
            raise TrialPruned(f"pruned by Optuna at step {step} ({book.monitor} {value:.4g})")


def _open_trial(storage_url: str, study_name: str, number: int) -> Any:
    """The RUNNING trial ``number`` that the sweeper asked for, with the study's pruner
    (stored by the sweeper on the trial: a pruner is not part of the storage)."""
    import optuna
    from hydra.utils import instantiate

    storage = open_storage(storage_url)
    study_id = storage.get_study_id_from_name(study_name)
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
    pruner_cfg = storage.get_trial(trial_id).user_attrs.get("pruner")
    pruner = instantiate(pruner_cfg) if pruner_cfg else optuna.pruners.NopPruner()
    study = optuna.load_study(study_name=study_name, storage=storage, pruner=pruner)
    return optuna.trial.Trial(study, trial_id)
