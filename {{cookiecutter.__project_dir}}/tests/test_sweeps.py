"""Multiruns: one run dir per job, the ranked summary, failing jobs, the Optuna
study continued by a second command, submitit's local launcher, experiments."""

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from .conftest import CONFIG_DIR, ENV, FAST, PROJECT_ROOT, run_train

TRAIN = str(PROJECT_ROOT / "train.py")
SHORT = [*FAST, "trainer.max_steps=20"]


def multirun(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``python train.py -m OVERRIDES`` in ``cwd`` (its runs/ land there)."""
    return subprocess.run(
        [sys.executable, TRAIN, "-m", *overrides],
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
    # Job 0 is refused (a learning rate must be > 0); job 1 still runs.
    proc = multirun(tmp_path, "optimizer.lr=-1,3e-3", *SHORT, f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 1
    assert "optimizer.lr=-1 is not allowed" in proc.stderr
    assert json.loads((sweep / "1" / "summary.json").read_text())["step"] == 20
    rows = {r["job"]: r for r in summary_rows(sweep)}
    assert rows["1"]["status"] == "completed" and rows["1"]["rank"] == "1"
    assert rows["0"]["status"] == "failed" and rows["0"]["rank"] == ""
    assert "optimizer.lr=-1 is not allowed" in rows["0"]["error"]
    assert "1 completed, 1 failed" in (sweep / "summary.md").read_text()


@pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None,
    reason="hydra-optuna-sweeper is not installed (pip install '.[optuna]')",
)
def test_the_same_optuna_command_twice_continues_the_study(tmp_path):
    import optuna

    command = ["hparams_search=optuna", "hydra.sweeper.n_trials=3", *SHORT]
    for _ in range(2):
        proc = multirun(tmp_path, *command)
        assert proc.returncode == 0, proc.stderr[-3000:]
    study_dir = tmp_path / "runs" / "optuna" / "digits"
    study = optuna.load_study(study_name="digits", storage=f"sqlite:///{study_dir / 'study.db'}")
    assert len(study.trials) == 6
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)

    runs = sorted(p.parent for p in study_dir.glob("*/*/summary.json"))
    assert len(runs) == 6 and len({r.parent for r in runs}) == 2  # two sweep dirs of 3
    best = {json.loads((r / "summary.json").read_text())["best"]["value"] for r in runs}
    assert best == {t.value for t in study.trials}  # each trial's value is its run's best
    for sweep_dir in {r.parent for r in runs}:
        assert len(summary_rows(sweep_dir)) == 3


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
        option_cfg = OmegaConf.load(CONFIG_DIR / group / f"{option}.yaml")
        is_global = "@package _global_" in (CONFIG_DIR / group / f"{option}.yaml").read_text()
        values = flat(OmegaConf.to_container(option_cfg), "" if is_global else f"{group}.")
        expected.update({k: v for k, v in values.items() if "${" not in str(v)})
    return {**expected, **flat(bundle)}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_runs_with_its_values(name, tmp_path):
    run = run_train(tmp_path / name, f"experiment={name}", *SHORT)
    assert run.summary["step"] == 20  # the command line still wins over the bundle
    config = flat(json.loads((run.run_dir / "config.json").read_text()))
    expected = expected_values(name)
    assert expected
    # _target_ strings hold the package name: compare by their class name.
    assert {k: str(v).rsplit(".", 1)[-1] for k, v in expected.items()} == {
        k: str(config[k]).rsplit(".", 1)[-1] for k in expected
    }
