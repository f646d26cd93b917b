"""A Hydra sweeper on current Optuna, with Optuna's ask-and-tell API.

``python train.py -m hparams_search=optuna`` (configs/hydra/sweeper/optuna.yaml):
asks the study for ``n_jobs`` trials at a time, launches them as one batch
through the configured Hydra launcher (each trial its own job and run dir), and
tells the study each result: COMPLETE with the value ``train.py`` returned, PRUNED
when the job's pruner stopped it (``pruning.py`` reports every evaluation through
the storage), FAIL with the error otherwise (a crash, a NaN, no value), and goes
on with the next trials. The same command continues the study; trials that a
killed sweep left RUNNING on this host are marked FAIL when it starts again.

Search space (``hydra.sweeper.params`` or the command line), as Hydra's sweep
syntax: ``choice(a, b)`` categorical, ``range(1, 10)`` integers (``step``),
``interval(0.0, 1.0)`` floats (``tag(int, interval(1, 8))`` integers),
``tag(log, interval(...))`` log scale. Anything else is a
fixed override of every trial. Hydra imports this module whenever it scans its
plugins: optuna is imported only when a sweep runs.
"""

import logging
import math
import os
import socket
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, Transformer
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

TRIAL_KEY = "optuna_trial"  # the job's config section (configs/hparams_search/optuna.yaml)


class OptunaSweeper(Sweeper):
    def __init__(
        self,
        sampler: Any,
        pruner: Any,
        direction: str,
        storage: str | None,
        study_name: str | None,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        params: DictConfig | None,
    ) -> None:
        self.sampler_cfg = sampler
        self.pruner_cfg = pruner
        self.direction = direction
        self.storage = storage
        self.study_name = study_name
        self.n_trials = n_trials
        self.n_jobs = n_jobs
        self.max_failure_rate = max_failure_rate
        self.params = params or {}
        self.config: DictConfig | None = None
        self.launcher: Any = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> None:
        import optuna
        from hydra.utils import instantiate

        assert self.config is not None
        if self.n_jobs < 1 or self.n_trials < 0:
            raise ValueError("hydra.sweeper.n_jobs must be >= 1 and n_trials >= 0")
        space, fixed = search_space([f"{k}={v}" for k, v in self.params.items()] + arguments)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")

        storage_url = absolute_storage_url(self.storage)
        storage = None
        if storage_url is not None:
            from training_engine.pruning import open_storage

            storage = open_storage(storage_url)
        pruner_cfg = OmegaConf.to_container(self.pruner_cfg, resolve=True)
        study = optuna.create_study(
            study_name=self.study_name,
            storage=storage,
            sampler=instantiate(self.sampler_cfg),
            pruner=instantiate(pruner_cfg),
            direction=self.direction,
            load_if_exists=True,
        )
        if storage is not None:
            fail_abandoned_trials(study, storage)
        log.info(
            f"study {study.study_name!r} ({len(study.trials)} trials so far) in "
            f"{storage_url or 'memory (not kept; no pruning)'}: {self.n_trials} more, "
            f"{self.n_jobs} at a time, {self.direction} the returned value"
        )
        owner = {"host": socket.gethostname(), "pid": os.getpid()}
        job_idx, failed, told = 0, 0, 0
        while told < self.n_trials:
            trials = [study.ask(space) for _ in range(min(self.n_jobs, self.n_trials - told))]
            batch = []
            for trial in trials:
                trial.set_user_attr("sweeper", owner)
                trial.set_user_attr("pruner", pruner_cfg)
                overrides = [f"{k}={v}" for k, v in fixed.items()]
                overrides += [f"{k}={Transformer.str(v)}" for k, v in trial.params.items()]
                if storage_url is not None:  # the job reports to its trial (pruning.py)
                    overrides += [
                        f"{TRIAL_KEY}.storage={_quoted(storage_url)}",
                        f"{TRIAL_KEY}.study_name={_quoted(study.study_name)}",
                        f"{TRIAL_KEY}.number={trial.number}",
                    ]
                batch.append(overrides)
            try:
                self.validate_batch_is_legal(batch)
                returns = self.launcher.launch(batch, initial_job_idx=job_idx)
            except BaseException as err:  # no results (a bad override, Ctrl-C): not left RUNNING
                for trial in trials:
                    _fail(study, trial, f"not run: {type(err).__name__}: {err}")
                raise
            job_idx += len(returns)
            exhausted = False
            for trial, ret in zip(trials, returns, strict=True):
                state, stop = tell(study, trial, ret)
                failed += state == optuna.trial.TrialState.FAIL
                exhausted |= stop
            told += len(trials)
            if exhausted:
                log.info("the sampler has tried every combination of the search space")
                break

        self._write_results(study, sweep_dir)
        if told and failed / told > self.max_failure_rate:
            raise RuntimeError(
                f"{failed} of {told} trials failed (more than hydra.sweeper.max_failure_rate="
                f"{self.max_failure_rate}); their errors are in the sweep summary and the study"
            )

    def _write_results(self, study: Any, sweep_dir: Path) -> None:
        import optuna

        done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        counts = {
            s.name: len(study.get_trials(False, states=(s,))) for s in optuna.trial.TrialState
        }
        results: dict[str, Any] = {"study": study.study_name, "trials": counts}
        if done:
            best = study.best_trial
            results.update(best_trial=best.number, best_value=best.value, best_params=best.params)
            log.info(f"best trial {best.number}: {best.value:.4g} with {best.params}")
        OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")


def tell(study: Any, trial: Any, ret: Any) -> tuple[Any, bool]:
    """Record one job's outcome in the study; returns the state told, and whether
    the sampler wants the study to stop (brute force: every combination tried)."""
    try:
        return _tell(study, trial, ret), False
    except RuntimeError as err:
        # Samplers that run out call study.stop(), which only works inside
        # study.optimize; the trial's state is stored before that.
        if "Study.stop" not in str(err):
            raise
        return _stored(study, trial).state, True


def _tell(study: Any, trial: Any, ret: Any) -> Any:
    from optuna.trial import TrialState

    from training_engine.pruning import is_pruned
    from training_engine.upstream import job_result

    error = job_result(ret) if ret.status.name == "FAILED" else None
    if error is not None:
        pruned = is_pruned(error) or "pruned_at_step" in _stored(study, trial).user_attrs
        if pruned:
            study.tell(trial, state=TrialState.PRUNED)
            log.info(f"trial {trial.number} pruned")
            return TrialState.PRUNED
        return _fail(study, trial, f"{type(error).__name__}: {error}")
    value = job_result(ret)
    if not isinstance(value, int | float) or not math.isfinite(value):
        return _fail(study, trial, f"the run returned {value!r}, not a finite number")
    study.tell(trial, float(value))
    return TrialState.COMPLETE


def _fail(study: Any, trial: Any, error: str) -> Any:
    from optuna.trial import TrialState

    error = " ".join(error.split())[:1000]
    trial.set_user_attr("error", error)
    study.tell(trial, state=TrialState.FAIL)
    log.warning(f"trial {trial.number} failed: {error}")
    return TrialState.FAIL


def _stored(study: Any, trial: Any) -> Any:
    return next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)


def fail_abandoned_trials(study: Any, storage: Any) -> None:
    """Trials left RUNNING by a sweep of this host that is gone (killed, crashed)
    become FAIL, so a continued study never counts them. Trials of a sweep on
    another host, or of one still running here, are left alone."""
    from optuna.trial import TrialState

    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = trial.user_attrs.get("sweeper") or {}
        if owner.get("host") != host or _alive(owner.get("pid")):
            continue
        message = f"abandoned: its sweep (pid {owner.get('pid')}) ended before the trial did"
        study_id = storage.get_study_id_from_name(study.study_name)
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        storage.set_trial_user_attr(trial_id, "error", message)
        study.tell(trial.number, state=TrialState.FAIL)
        log.warning(f"trial {trial.number} marked FAIL: {message}")


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()


def search_space(arguments: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Optuna distributions of the sweep overrides, and the fixed overrides."""
    space: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(arguments):
        key = override.get_key_element()
        if override.is_sweep_override():
            space[key] = distribution(override)
            fixed.pop(key, None)
        else:
            fixed[key] = override.get_value_element_as_str()
            space.pop(key, None)
    return space, fixed


def distribution(override: Override) -> Any:
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    value = override.value()
    tags = getattr(value, "tags", set())
    if override.is_interval_sweep():
        if "int" in tags:  # Hydra parses interval ends as floats
            return IntDistribution(int(value.start), int(value.end), log="log" in tags)
        return FloatDistribution(value.start, value.end, log="log" in tags)
    values = list(override.sweep_iterator(transformer=Transformer.encode))
    if override.is_range_sweep() and not value.shuffle and all(isinstance(v, int) for v in values):
        step = int(value.step)
        return IntDistribution(min(values), max(values), step=step, log="log" in tags)
    return CategoricalDistribution(values)  # choice(...), float or shuffled ranges


def absolute_storage_url(url: str | None) -> str | None:
    """A relative sqlite path made absolute (jobs may run in another directory),
    its directory created."""
    if not url or not url.startswith("sqlite:///"):
        return url or None
    path = Path(url.removeprefix("sqlite:///")).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def _quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
