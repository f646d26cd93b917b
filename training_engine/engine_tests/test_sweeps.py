"""Multiruns: one run dir per job, the ranked summary, failing jobs, submitit's
local launcher, experiments; the Optuna sweeper: the study continued by a second
command, pruning (also under DDP), failed and killed trials, parallel trials."""

import csv
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from .conftest import CONFIG_DIR, CONFIG_FILES, ENV, FAST, ONE_PROCESS, PROJECT_ROOT, run_train

TRAIN = str(PROJECT_ROOT / "train.py")
SHORT = [*FAST, "trainer.max_steps=20"]


def multirun(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``python train.py -m OVERRIDES`` in ``cwd``; its runs land in cwd/runs/."""
    return subprocess.run(
        [sys.executable, TRAIN, "-m", ONE_PROCESS, *overrides, f"runs_root={cwd / 'runs'}"],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


def summary_rows(sweep_dir: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((sweep_dir / "summary.csv").open()))


def test_a_2x2_sweep_has_4_run_dirs_and_a_ranked_summary(tmp_path):
    sweep = tmp_path / "sweep"
    proc = multirun(
        tmp_path, "optimizer.lr=1e-3,1e-2", "seed=1,2", *SHORT, f"hydra.sweep.dir={sweep}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = {}
    for job in "0123":
        config = json.loads((sweep / job / "config.json").read_text())
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert any((sweep / job / "checkpoints").glob("step_*"))
        jobs[job] = (config["optimizer"]["lr"], config["seed"], summary["best"]["value"])
    assert {(lr, seed) for lr, seed, _ in jobs.values()} == {
        (1e-3, 1),
        (1e-3, 2),
        (1e-2, 1),
        (1e-2, 2),
    }

    rows = summary_rows(sweep)
    assert [r["rank"] for r in rows] == ["1", "2", "3", "4"]
    assert all(r["status"] == "completed" and r["monitor"] == "val/acc" for r in rows)
    best = [float(r["best"]) for r in rows]
    assert best == sorted(best, reverse=True)  # val/acc: higher first
    for row in rows:  # each row is its job, and names what varied
        lr, seed, value = jobs[row["job"]]
        assert float(row["best"]) == value
        assert f"seed={seed}" in row["overrides"] and f"optimizer.lr={lr}" in row["overrides"]
        assert "trainer.max_steps" not in row["overrides"]  # common to all jobs
    table = (sweep / "summary.md").read_text()
    assert "4 jobs: 4 completed, 0 failed" in table
    assert table.count("| completed |") == 4


def test_a_failing_job_does_not_stop_the_sweep_and_is_listed(tmp_path):
    sweep = tmp_path / "sweep"
    # Job 0 is refused (torch's AdamW: a learning rate must be >= 0); job 1 still runs.
    proc = multirun(tmp_path, "optimizer.lr=-1,3e-3", *SHORT, f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 1
    refused = "optimizer: cannot build torch.optim.AdamW(lr=-1, weight_decay=0.01): Invalid"
    assert refused in proc.stderr
    assert json.loads((sweep / "1" / "summary.json").read_text())["step"] == 20
    rows = {r["job"]: r for r in summary_rows(sweep)}
    assert rows["1"]["status"] == "completed" and rows["1"]["rank"] == "1"
    assert rows["0"]["status"] == "failed" and rows["0"]["rank"] == ""
    assert refused in rows["0"]["error"]
    assert "1 completed, 1 failed" in (sweep / "summary.md").read_text()


needs_optuna = pytest.mark.skipif(
    importlib.util.find_spec("optuna") is None,
    reason="optuna is not installed (pip install '.[optuna]')",
)
OPTUNA = ["hparams_search=optuna", *SHORT]
# One bad and one good learning rate, each tried once (brute force); the other
# searched keys fixed. A trial still at chance accuracy (< 0.25) at its first
# evaluation (step 10) is pruned by the threshold pruner.
GOOD_AND_BAD = [
    "hydra/sweeper/sampler=brute_force",
    "hydra.sweeper.n_trials=2",
    "optimizer.weight_decay=0.0",
    "model.width=64",
]
THRESHOLD = ["hydra/sweeper/pruner=threshold", "hydra.sweeper.pruner.lower=0.25"]


def load_study(cwd: Path, name: str = "digits"):
    import optuna

    path = cwd / "runs" / "optuna" / name / "study.db"
    return optuna.load_study(study_name=name, storage=f"sqlite:///{path}")


def states(study) -> list[str]:
    return [t.state.name for t in sorted(study.trials, key=lambda t: t.number)]


def test_hydra_finds_the_optuna_sweeper():
    from hydra.core.plugins import Plugins
    from hydra.plugins.sweeper import Sweeper

    found = [f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Sweeper)]
    target = OmegaConf.load(CONFIG_FILES["hydra/sweeper", "optuna"])._target_
    assert target in found


@needs_optuna
def test_search_space_syntax():
    from optuna.distributions import CategoricalDistribution as Cat
    from optuna.distributions import FloatDistribution as Float
    from optuna.distributions import IntDistribution as Int

    plugin = OmegaConf.load(CONFIG_FILES["hydra/sweeper", "optuna"])._target_
    search_space = importlib.import_module(plugin.rsplit(".", 1)[0]).search_space
    space, fixed = search_space(
        [
            "a=tag(log, interval(1e-4, 1e-2))",
            "b=interval(0.0, 0.5)",
            "c=tag(int, interval(1, 8))",
            "d=range(2, 10, 2)",
            "e=choice(relu, gelu)",
            "f=3",
            "b=0.1",  # a later fixed value takes a key out of the search
        ]
    )
    assert space == {
        "a": Float(1e-4, 1e-2, log=True),
        "c": Int(1, 8),
        "d": Int(2, 8, step=2),
        "e": Cat(["relu", "gelu"]),
    }
    assert fixed == {"f": "3", "b": "0.1"}


@needs_optuna
def test_a_nan_or_missing_value_fails_its_trial():
    import optuna
    from hydra.core.utils import JobReturn, JobStatus

    plugin = OmegaConf.load(CONFIG_FILES["hydra/sweeper", "optuna"])._target_
    tell = importlib.import_module(plugin.rsplit(".", 1)[0]).tell
    study = optuna.create_study()
    for value in (float("nan"), None, 0.5):
        ret = JobReturn(status=JobStatus.COMPLETED, _return_value=value)
        tell(study, study.ask(), ret)
    assert states(study) == ["FAIL", "FAIL", "COMPLETE"]
    assert "not a finite number" in study.trials[0].user_attrs["error"]


@needs_optuna
def test_the_same_optuna_command_twice_continues_the_study(tmp_path):
    # No pruner: the default median pruner may judge the 6th trial (its
    # n_startup_trials is 5), and with an unseeded sampler that trial's random
    # parameters are pruned whenever it trails the first five's median at an
    # evaluation (CI saw PRUNED once). Pruning has its own tests below.
    command = [*OPTUNA, "hydra.sweeper.n_trials=3", "hydra/sweeper/pruner=none"]
    for _ in range(2):
        proc = multirun(tmp_path, *command)
        assert proc.returncode == 0, proc.stderr[-3000:]
    study = load_study(tmp_path)
    assert states(study) == ["COMPLETE"] * 6

    study_dir = tmp_path / "runs" / "optuna" / "digits"
    runs = sorted(p.parent for p in study_dir.glob("*/*/summary.json"))
    assert len(runs) == 6 and len({r.parent for r in runs}) == 2  # two sweep dirs of 3
    best = {json.loads((r / "summary.json").read_text())["best"]["value"] for r in runs}
    assert best == {t.value for t in study.trials}  # each trial's value is its run's best
    assert {t.user_attrs["run_dir"] for t in study.trials} == {str(r) for r in runs}
    for sweep_dir in {r.parent for r in runs}:
        assert len(summary_rows(sweep_dir)) == 3


@needs_optuna
def test_optuna_prunes_a_bad_configuration(tmp_path):
    proc = multirun(tmp_path, *OPTUNA, *GOOD_AND_BAD, *THRESHOLD, "optimizer.lr=choice(1e-6,3e-2)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = {t.params["optimizer.lr"]: t for t in load_study(tmp_path).trials}
    assert trials[3e-2].state.name == "COMPLETE"
    bad = trials[1e-6]
    assert bad.state.name == "PRUNED"
    assert bad.user_attrs["pruned_at_step"] == 10 and list(bad.intermediate_values) == [10]
    run_dir = Path(bad.user_attrs["run_dir"])
    assert (run_dir / "checkpoints" / "step_0000010").is_dir()  # kept: it can be resumed
    assert not (run_dir / "summary.json").exists()
    rows = {r["status"]: r for r in summary_rows(run_dir.parent)}
    assert rows["pruned"]["rank"] == "" and "pruned by Optuna at step 10" in rows["pruned"]["error"]
    assert rows["completed"]["rank"] == "1"
    assert "2 jobs: 1 completed, 1 pruned, 0 failed" in (run_dir.parent / "summary.md").read_text()


@needs_optuna
@pytest.mark.slow  # CI's time budget: runs with -m slow
@pytest.mark.multiprocess
def test_optuna_pruning_stops_every_ddp_rank(tmp_path):
    proc = multirun(
        tmp_path,
        *OPTUNA,
        *THRESHOLD,
        "parallel=ddp",
        "hydra.sweeper.n_trials=1",
        "optimizer.lr=1e-6",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (trial,) = load_study(tmp_path).trials
    assert trial.state.name == "PRUNED" and trial.user_attrs["pruned_at_step"] == 10
    run_dir = Path(trial.user_attrs["run_dir"])
    for log in ("train.log", "train_rank1.log"):  # both ranks stopped at the same step
        text = (run_dir / log).read_text()
        assert "pruned by Optuna at step 10" in text and "step 15/20" not in text


@needs_optuna
def test_a_failing_trial_is_failed_and_the_sweep_goes_on(tmp_path):
    proc = multirun(tmp_path, *OPTUNA, *GOOD_AND_BAD, "optimizer.lr=choice(-1,3e-3)")
    assert proc.returncode == 0, proc.stderr[-3000:]  # 1 of 2 failed: max_failure_rate 0.5
    trials = {t.params["optimizer.lr"]: t for t in load_study(tmp_path).trials}
    assert trials[3e-3].state.name == "COMPLETE"
    assert trials[-1].state.name == "FAIL"
    assert "cannot build torch.optim.AdamW(lr=-1" in trials[-1].user_attrs["error"]


@needs_optuna
def test_a_killed_sweep_continues_and_its_interrupted_trial_fails(tmp_path):
    # A slow first trial, killed with its sweep (-9) while it trains.
    log = (tmp_path / "first.log").open("w")
    sweep = subprocess.Popen(
        [
            sys.executable,
            TRAIN,
            "-m",
            ONE_PROCESS,
            *OPTUNA,
            "hydra.sweeper.n_trials=3",
            "model._target_=engine_tests.faults.Slow",
            "trainer.max_steps=2000",
            f"runs_root={tmp_path / 'runs'}",
        ],
        cwd=tmp_path,
        env=ENV,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_glob(tmp_path, "runs/optuna/digits/*/0/checkpoints/step_0000010")
    finally:
        os.killpg(sweep.pid, signal.SIGKILL)
        sweep.wait()
    assert states(load_study(tmp_path)) == ["RUNNING"]

    proc = multirun(tmp_path, *OPTUNA, "hydra.sweeper.n_trials=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = load_study(tmp_path)
    assert states(study) == ["FAIL", "COMPLETE"]
    assert "abandoned" in study.trials[0].user_attrs["error"]
    assert len(study.get_trials(states=(optuna_state("COMPLETE"),))) == 1


def optuna_state(name: str):
    import optuna

    return optuna.trial.TrialState[name]


def wait_for_glob(root: Path, pattern: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(root.glob(pattern)):
        assert time.monotonic() < deadline, f"{pattern} did not appear"
        time.sleep(0.2)


@needs_optuna
@pytest.mark.slow  # CI's time budget: runs with -m slow
@pytest.mark.multiprocess
@pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
    reason="hydra-submitit-launcher is not installed (pip install '.[slurm]')",
)
def test_optuna_runs_n_jobs_trials_at_once_through_the_launcher(tmp_path):
    proc = multirun(
        tmp_path,
        *OPTUNA,
        "hydra/launcher=submitit_local",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.n_trials=2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = load_study(tmp_path)
    assert states(study) == ["COMPLETE", "COMPLETE"]
    first, second = sorted(study.trials, key=lambda t: t.number)
    assert first.user_attrs["run_dir"] != second.user_attrs["run_dir"]
    # Side by side: each started before the other ended.
    assert second.datetime_start < first.datetime_complete
    starts = [Path(t.user_attrs["run_dir"], "config.json").stat().st_mtime for t in study.trials]
    ends = [Path(t.user_attrs["run_dir"], "summary.json").stat().st_mtime for t in study.trials]
    assert max(starts) < min(ends)


@pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
    reason="hydra-submitit-launcher is not installed (pip install '.[slurm]')",
)
def test_submitit_local_launcher_runs_the_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    proc = multirun(
        tmp_path, "hydra/launcher=submitit_local", "seed=1,2", *SHORT, f"hydra.sweep.dir={sweep}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = summary_rows(sweep)  # written by the job processes: the package is importable there
    assert sorted(r["job"] for r in rows) == ["0", "1"]
    assert all(r["status"] == "completed" for r in rows)


EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))


def test_experiments_were_found():
    assert len(EXPERIMENTS) >= 2


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def expected_values(name: str) -> dict:
    """What ``experiment=NAME`` must set: its own values, and the values of the
    options it selects (``override /group: option``) that it does not set itself."""
    bundle = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "experiment" / f"{name}.yaml"))
    expected = {}
    for entry in bundle.pop("defaults", []):
        ((key, option),) = entry.items()
        group = key.removeprefix("override /")
        option_cfg = OmegaConf.load(CONFIG_FILES[group, option])
        is_global = "@package _global_" in CONFIG_FILES[group, option].read_text()
        values = flat(OmegaConf.to_container(option_cfg), "" if is_global else f"{group}.")
        expected.update({k: v for k, v in values.items() if "${" not in str(v)})
    return {**expected, **flat(bundle)}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_runs_with_its_values(name, tmp_path):
    run = run_train(tmp_path / name, f"experiment={name}", *SHORT)
    assert run.summary["step"] == 20  # the command line still wins over the bundle
    config = flat(json.loads((run.run_dir / "config.json").read_text()))
    # What the command line set wins (checked above and below); the bundle's other keys.
    given = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in SHORT}
    expected = {
        k: v
        for k, v in expected_values(name).items()
        if not any(k == g or k.startswith(f"{g}.") for g in given)
    }
    assert expected
    assert {k: str(config[k]) for k in given if k in config} == {
        k: v for k, v in given.items() if k in config
    }
    # _target_ strings hold the package name: compare by their class name.
    assert {k: str(v).rsplit(".", 1)[-1] for k, v in expected.items()} == {
        k: str(config[k]).rsplit(".", 1)[-1] for k in expected
    }
