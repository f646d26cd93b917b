"""Every option of every config group composes, validates and instantiates."""

import importlib.util
import os
import re

import pytest
import torch
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf
from training_engine.adapters import base_node
from training_engine.config import check_config, resolve_config
from training_engine.schedules import steps_on_metric
from training_engine.task import build_task
from training_engine.testing import config_options
from training_engine.tracking import build_trackers

from .conftest import PROJECT_ROOT, require_trackers

# The project's groups and the engine's (configs/train.yaml's search path).
FILES = config_options(PROJECT_ROOT)
OPTIONS = sorted(FILES)


def needs(group: str, option: str) -> list[str]:
    """The overrides an option is composed with here: its ``# needs: OVERRIDE ...``
    comment lines (text in parentheses is the reason). An option of your own that
    works only with another choice says so in its YAML; this file stays as it is."""
    text = FILES[(group, option)].read_text()
    found = re.findall(r"^# needs:([^(\n]*)", text, flags=re.MULTILINE)
    return [override for line in found for override in line.split()]


def build(node):
    """The object an option's node builds. Only where TESTS_SKIP_MISSING_EXTRAS=1 says
    that the environment lacks extras on purpose is an option whose package is missing
    (data=hf or model=hf without the hf extra) a skip."""
    try:
        return instantiate(node)
    except Exception as err:
        cause = err
        while cause is not None and not isinstance(cause, ImportError):
            cause = cause.__cause__
        missing = cause is not None or "pip install -e '.[" in str(err)
        if missing and os.environ.get("TESTS_SKIP_MISSING_EXTRAS") == "1":
            pytest.skip(f"not installed here: {getattr(cause, 'name', None) or err}")
        raise


def test_options_were_found():
    groups = {group for group, _ in OPTIONS}
    assert len(OPTIONS) >= 15
    assert {"model", "data", "optimizer", "scheduler", "trainer", "seeding", "parallel"} <= groups
    assert {"tracker", "checkpoint", "preflight", "task", "callbacks"} <= groups


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_instantiates(group, option, compose_cfg, tmp_path):
    if group.startswith("hydra/"):
        if (group, option) == ("hydra/launcher", "slurm") and importlib.util.find_spec(
            "hydra_plugins.hydra_submitit_launcher"
        ) is None:
            pytest.skip("hydra-submitit-launcher is not installed (pip install '.[slurm]')")
        # The sampler and pruner groups live inside the Optuna sweeper's config.
        sweeper = ["hydra/sweeper=optuna"] if group.startswith("hydra/sweeper/") else []
        cfg = compose_cfg(*sweeper, f"{group}={option}", hydra_config=True)
        node = OmegaConf.select(cfg, group.replace("/", "."))
        if group == "hydra/callbacks":  # a mapping of callbacks: none has no sweep summary
            assert all("_target_" in callback for callback in node.values())
            assert ("sweep_summary" in node) == (option != "none")
            assert "launch_folders" in node  # configs/train.yaml's own, kept by none
        else:
            assert node is not None and "_target_" in node
        return
    cfg = compose_cfg(f"{group}={option}", *needs(group, option))
    resolved = resolve_config(cfg)
    assert "${" not in OmegaConf.to_yaml(resolved)
    check_config(resolved)

    # Build the real objects every run builds from this config.
    task = build_task(resolved.task)
    model = build(base_node(resolved.model))  # model.peft is the engine's (adapters.py)
    optimizer = instantiate(resolved.optimizer)(task.param_groups(model))
    scheduler = instantiate(resolved.scheduler)(optimizer, total_steps=100)
    loaders = build(resolved.data)
    batch = next(iter(loaders.train))
    loss, logs = task.loss(model=model, batch=batch)  # the task's own loss of a real batch
    assert loss.ndim == 0 and torch.isfinite(loss) and all(v.ndim == 0 for v in logs.values())
    loss.backward()
    optimizer.step()
    scheduler.step(*([1.0] if steps_on_metric(scheduler) else []))  # plateau: on a metric
    assert scheduler.get_last_lr()[0] > 0

    # The option really selected what its name says.
    if group == "seeding":
        assert resolved.deterministic is (option == "deterministic")
    if group == "parallel":
        assert resolved.parallel.mode == option
    if group in ("model", "data", "task"):  # the object its _target_ names was built
        target = get_object(resolved[group]._target_)
        built = {"model": model, "data": loaders, "task": task}[group]
        assert isinstance(built, target) if isinstance(target, type) else built is not None
    if group == "preflight":
        assert resolved.preflight.enabled is (option == "default")
    if group == "tracker":
        assert list(resolved.tracker) == ([] if option == "none" else [option])
        require_trackers(option)  # last: skips only where the extras are missing on purpose
        trackers = build_trackers(resolved, tmp_path)
        assert [t.name for t in trackers] == list(resolved.tracker)
