"""The declared interfaces: the engine imports none of the owner's files, a task is
checked before any work, ``task=`` picks one of the project's tasks, callbacks come
from config and their state travels in the checkpoint."""

import ast
import json
from pathlib import Path

import pytest
import torch

import training_engine
from training_engine.config import ConfigError
from training_engine.task import build_task, check_task

from .conftest import FAST

PACKAGE = "digit_trainer"
ENGINE = Path(training_engine.__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, relative imports resolved against its package."""
    package = ".".join(path.relative_to(ENGINE.parent).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def test_the_engine_imports_none_of_the_owners_files():
    offenders = {}
    for path in sorted(ENGINE.rglob("*.py")):
        owner = {m for m in imported_modules(path) if m == PACKAGE or m.startswith(f"{PACKAGE}.")}
        if owner:
            offenders[str(path.relative_to(ENGINE))] = sorted(owner)
    assert not offenders, offenders
    assert len(list(ENGINE.rglob("*.py"))) > 40  # the walk saw the engine


class NoLoss:
    """A task without a loss, a training step or an evaluation."""

    metrics = ("val/acc",)

    def inputs(self, *, batch):
        return batch[0]


def test_a_task_missing_methods_is_refused_naming_them():
    with pytest.raises(ConfigError) as err:
        check_task(NoLoss(), predicts=True)  # predict.py's check: predict too
    message = str(err.value)
    for missing in ("has no loss", "has no training_step", "has no evaluate", "has no predict"):
        assert missing in message
    assert "has no inputs" not in message
    with pytest.raises(ConfigError) as err:
        check_task(NoLoss())  # training's: no predict needed
    assert "has no loss" in str(err.value) and "predict" not in str(err.value)


def test_train_py_refuses_such_a_task_before_any_work(train_run, tmp_path):
    run = train_run("task._target_=engine_tests.test_interfaces.NoLoss", *FAST, check=False)
    assert run.proc.returncode == 2, run.output[-2000:]
    assert "test_interfaces.NoLoss is not a task: has no batch_size" in run.output
    assert not run.run_dir.exists()  # bad input: nothing left


def test_task_picks_one_of_the_projects_tasks(compose_cfg):
    from training_engine.config import resolve_config

    def built(*overrides):
        return type(build_task(resolve_config(compose_cfg(*overrides)).task)).__name__

    assert built() == "Classification"
    assert built("model=gpt", "data=tokens") == "LanguageModel"  # model=gpt's own choice
    assert built("model=gpt", "data=tokens", "task=classification") == "Classification"
    lm = build_task(resolve_config(compose_cfg("task=language_model")).task)
    assert lm.metrics == ("val/loss", "val/acc", "val/ppl")
    batch = (torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))
    assert lm.batch_size(batch=batch) == (4, 32)  # every position one prediction


class CountEvals:
    """A callback with state: how many evaluations it saw, and their monitored values."""

    def __init__(self, out: str) -> None:
        self.out, self.seen = Path(out), []

    def on_eval_end(self, run, metrics):
        self.seen.append([run.step, round(metrics["val/acc"], 6)])
        if run.accelerator.is_main_process:
            self.out.write_text(json.dumps(self.seen))

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = [list(s) for s in state["seen"]]


def test_a_callback_from_config_keeps_its_state_across_a_resume(train_run, tmp_path):
    """A callback named on the command line runs at every evaluation; its state is in
    each checkpoint and a resumed run continues it: its record equals an uninterrupted
    run's."""
    target = "+callbacks.counter._target_=engine_tests.test_interfaces.CountEvals"
    constant = "scheduler=constant"  # the schedule does not depend on max_steps
    whole = tmp_path / "whole.json"
    train_run(*FAST, constant, target, f"+callbacks.counter.out={whole}")
    resumed = tmp_path / "resumed.json"
    run_dir = tmp_path / "resumed"
    from .conftest import run_train

    common = (*FAST, constant, target, f"+callbacks.counter.out={resumed}")
    run_train(run_dir, *common, "trainer.max_steps=20")  # stops at step 20 (saved)
    state = json.loads((run_dir / "checkpoints/step_0000020/trainer_state.json").read_text())
    assert [s[0] for s in state["stateful"]["callbacks.counter"]["seen"]] == [10, 20]
    run_train(run_dir, *common)  # the same run, now to step 30: resumes at 20
    assert json.loads(resumed.read_text()) == json.loads(whole.read_text())
    assert [s[0] for s in json.loads(whole.read_text())] == [10, 20, 30]
