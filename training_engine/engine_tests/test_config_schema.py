"""The engine's typed config (training_engine/schema/): every key declared once with
its doc and default; every bad value of every key refused before any work (exit 2)
naming key, value and what is allowed; a preset that sets an undeclared key stopped
at composition; a config written before a key existed still resumes; the docs' table
is the schema's. In-process: one composition, then each value on a copy."""

import copy
import dataclasses
import shutil

import pytest
from omegaconf import OmegaConf

from training_engine import schema
from training_engine.accel import resolve_precision
from training_engine.config import (
    ConfigError,
    allowed_config_changes,
    check_config,
    config_differences,
    resolve_config,
)
from training_engine.schema.fields import inner_section, plain
from training_engine.testing import compose_train

from .conftest import PROJECT_ROOT


def declared_keys() -> dict[str, dataclasses.Field]:
    """Every leaf key of the schemas (dotted) and its field."""
    found = {}

    def walk(cls: type, prefix: str) -> None:
        for field in dataclasses.fields(cls):
            inner = inner_section(cls, field.name)
            if inner is not None and field.default_factory is inner:
                walk(inner, f"{prefix}{field.name}.")
            else:
                found[f"{prefix}{field.name}"] = field

    walk(schema.Run, "")
    for key, cls in schema.SCHEMAS.items():
        walk(cls, f"{key}.")
    for name, cls in schema.TRACKERS.items():
        walk(cls, f"tracker.{name}.")
    walk(schema.Profile, "debug.profile.")  # debug.profile: null until a preset sets it
    return found


# Values each checked key refuses once the config is resolved. Values of another type
# stop at composition (test_a_value_of_the_wrong_type_...); a bool key holds a bool
# there, so its bad value here is what a project's untyped group file could hold.
BAD = {
    "project": [""],
    "seed": [-1, 2**32],
    "deterministic": ["maybe"],
    "trusted_targets": [["not a module"], "mylib"],
    "optimizers": [["adam"]],
    "frozen_models": ["teacher"],
    "trainer.max_epochs": [0],
    "trainer.max_steps": [0, -3],
    "trainer.grad_accum_steps": [0],
    "trainer.grad_clip_norm": [0, -1.5],
    "trainer.mixed_precision": ["fp8", True],
    "trainer.compile": ["maybe"],
    "trainer.peak_tflops": [0],
    "trainer.log_every_n_steps": [0],
    "trainer.eval_every_n_steps": [0],
    "trainer.eval_at_start": ["maybe"],
    "trainer.monitor_mode": ["up"],
    "trainer.on_nan": ["ignore"],
    "trainer.skip_budget": [0],
    "trainer.early_stopping.patience": [0],
    "trainer.early_stopping.min_delta": [-0.1],
    "trainer.ema.enabled": ["maybe"],
    "trainer.ema.decay": [0, 1, 1.5],
    "parallel.mode": ["horovod"],
    "parallel.num_processes": [0, "all"],
    "parallel.cpu_processes": [0],
    "parallel.num_nodes": [0],
    "parallel.node_rank": [-1],
    "parallel.master_port": [0, 70000],
    "parallel.backend": ["mpi"],
    "parallel.timeout_s": [0],
    "parallel.max_restarts": [-1],
    "parallel.find_unused_parameters": ["maybe"],
    "parallel.wrap_classes": [[], ["not a class"]],
    "parallel.auto_wrap_min_params": [0],
    "parallel.reshard_after_forward": ["maybe"],
    "parallel.cpu_offload": ["maybe"],
    "parallel.activation_checkpointing": ["maybe"],
    "parallel.zero_stage": [4],
    "parallel.offload_optimizer": ["nvme"],
    "parallel.offload_params": ["disk"],
    "parallel.zero3_init": ["maybe"],
    "checkpoint.enabled": ["maybe"],
    "checkpoint.every_n_steps": [0],
    "checkpoint.every_n_epochs": [0],
    "checkpoint.keep_last": [1],
    "checkpoint.save_best.enabled": ["maybe"],
    "checkpoint.save_best.mode": ["up"],
    "checkpoint.save_last": ["maybe"],
    "checkpoint.resume": ["/no/such/dir", ""],
    "checkpoint.init_from": ["/no/such/dir"],
    "checkpoint.init_from_pick": ["worst"],
    "checkpoint.init_from_weights": ["swa"],
    "checkpoint.init_from_strict": ["maybe"],
    "checkpoint.save_on_signal": ["maybe"],
    "checkpoint.async_save": ["maybe"],
    "checkpoint.format": ["zip"],
    "checkpoint.weights": ["adapter"],
    "preflight.enabled": ["maybe"],
    "preflight.only": ["maybe"],
    "preflight.warmup_steps": [-1],
    "preflight.timed_steps": [0],
    "preflight.min_timed_seconds": [-1],
    "preflight.eval_batches": [-1],
    "preflight.disk_test_mib": [0],
    "preflight.memory_warn_fraction": [0, 1],
    "preflight.loader_warn_fraction": [1.5],
    "debug.train_batches": [0],
    "debug.val_batches": [0],
    "debug.val_on_train": ["maybe"],
    "debug.detect_anomaly": ["maybe"],
    "debug.profile.wait": [-1],
    "debug.profile.warmup": [-1],
    "debug.profile.active": [0],
    "debug.profile.record_shapes": ["maybe"],
    "debug.profile.profile_memory": ["maybe"],
    "debug.profile.row_limit": [0],
    "watchdog.enabled": ["sometimes"],
    "watchdog.first_step_s": [0],
    "watchdog.step_floor_s": [-5],
    "watchdog.step_factor": [0],
    "watchdog.eval_s": [0],
    "watchdog.save_s": [0],
    "watchdog.poll_s": [0],
    "watchdog.collective_timeout_s": [0],
    "tracker.csv.filename": [],  # any name
    "tracker.tensorboard.hparam_metrics": [],
    "tracker.wandb.mode": ["cloud"],
    "tracker.wandb.tags": [],
    "tracker.wandb.watch.log": ["weights"],
    "tracker.wandb.watch.log_freq": [0],
    "tracker.mlflow.log_model": ["maybe"],
}
# The combinations the schemas refuse, and check_config's across groups.
CROSS = {
    ("trainer.max_epochs=null", "trainer.max_steps=null"): "trainer.max_epochs and "
    "trainer.max_steps are both null: set at least one",
    ("parallel.node_rank=2",): "parallel.node_rank=2 is not allowed: expected 0..0 "
    "(parallel.num_nodes=1)",
    ("parallel.num_nodes=2",): "parallel.master_port=None is not allowed with parallel.num_nodes=2",
    ("preflight=off", "preflight.only=true"): "preflight.only=true with preflight=off",
    ("parallel=fsdp", "trainer.ema.enabled=true"): "trainer.ema.enabled=true is not "
    "supported with parallel=fsdp",
    ("parallel=deepspeed", "+optimizers.d._target_=torch.optim.SGD"): "optimizers=['d'] is "
    "not supported with parallel=deepspeed",
}


@pytest.fixture(scope="module")
def resolved():
    """The default config, every tracker's settings and a profiler window included."""
    cfg = compose_train(PROJECT_ROOT, "tracker=[csv,tensorboard,wandb,mlflow]", "debug=profile")
    return resolve_config(cfg)


def test_every_key_has_a_type_a_doc_and_a_default_or_is_the_projects():
    for key, field in declared_keys().items():
        assert field.metadata["doc"].strip(), f"{key} has no doc"
        assert "\n" not in field.metadata["doc"], f"{key}: the doc is one line"
        given = field.default is not dataclasses.MISSING  # a value, or REQUIRED: the project's
        assert given or field.default_factory is not dataclasses.MISSING, f"{key}: no default"
        assert field.type, key
    # Only the top-level keys are the project's (configs/train.yaml); a group's have defaults.
    required = [k for k, f in declared_keys().items() if f.default == schema.run.REQUIRED]
    assert required and all("." not in key for key in required)


def test_every_checked_key_is_in_the_table_of_bad_values():
    checked = {k for k, f in declared_keys().items() if f.metadata["check"] is not None}
    assert checked == {k for k, values in BAD.items() if values}  # and no others
    assert set(BAD) <= set(declared_keys())


@pytest.mark.parametrize(("key", "value"), [(k, v) for k, vs in BAD.items() for v in vs])
def test_every_bad_value_is_refused_naming_key_value_and_what_is_allowed(resolved, key, value):
    cfg = copy.deepcopy(resolved)
    OmegaConf.update(cfg, key, value, merge=False)
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert err.value.exit_code == 2
    said = f"{key}={plain(value)!r} is not allowed: expected {schema.expected(key)}"
    assert said in str(err.value), str(err.value)
    assert len(str(err.value).splitlines()) == 2  # this problem alone


def test_the_defaults_and_every_good_value_pass(resolved):
    check_config(resolved)
    cfg = copy.deepcopy(resolved)
    for key, value in {
        "trainer.mixed_precision": False,  # YAML's unquoted `no`
        "trainer.max_epochs": None,  # with max_steps set
        "trainer.max_steps": 5,
        "parallel.num_processes": "auto",
        "parallel.master_port": 29500,
        "parallel.wrap_classes": ["Block"],
        "watchdog.enabled": True,
        "watchdog.collective_timeout_s": None,
        "tracker.wandb.watch.log": None,
        "checkpoint.resume": str(PROJECT_ROOT),
    }.items():
        OmegaConf.update(cfg, key, value, merge=False)
    check_config(cfg)


@pytest.mark.parametrize(("overrides", "message"), list(CROSS.items()))
def test_combinations_are_refused(overrides, message):
    with pytest.raises(ConfigError, match="Invalid configuration") as err:
        check_config(resolve_config(compose_train(PROJECT_ROOT, *overrides)))
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("override", "value"),
    [
        ("trainer.max_steps=abc", "abc"),  # int | None
        ("trainer.grad_clip_norm=much", "much"),  # float | None
        ("trainer.compile=maybe", "maybe"),  # bool
        ("trainer.mixed_precision=16", 16),  # str | bool
        ("parallel.num_processes=1.5", 1.5),  # int | str
        ("parallel.wrap_classes=Block", "Block"),  # list[str] | None
        ("watchdog.poll_s=often", "often"),
        ("tracker.csv.filename=[a,b]", ["a", "b"]),  # str
    ],
)
def test_a_value_of_the_wrong_type_stops_composition_naming_what_is_allowed(override, value):
    """As train.py says it (entry.py; exit 2): the same words as a value check."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        compose_train(PROJECT_ROOT, override)
    assert err.value.exit_code == 2
    assert str(err.value).startswith(f"{key}={value!r} is not allowed: expected ")
    assert str(err.value).endswith(schema.expected(key))


def test_an_undeclared_key_is_named_with_the_closest_one():
    for override, said in {
        "trainer.max_stepz=3": "trainer.max_stepz=3 is not a key of the config: did you mean "
        "trainer.max_steps",
        "checkpoint.async=true": "did you mean checkpoint.async_save",  # the key's new name
        "+trainer.max_stepz=3": "trainer.max_stepz is not a key of trainer: did you mean "
        "trainer.max_steps?",  # added on purpose: the schema still declares the keys
    }.items():
        with pytest.raises(ConfigError, match=r"Invalid configuration|is not a key") as err:
            check_config(resolve_config(compose_train(PROJECT_ROOT, override)))
        assert said in str(err.value)
        assert "+trainer.max_stepz" not in str(err.value)  # no advice to add one


def test_every_problem_of_a_command_line_is_named_at_once():
    """Hydra stops at the first override it refuses; the others are named with it."""
    with pytest.raises(ConfigError) as err:
        compose_train(PROJECT_ROOT, "tracker=nope", "trainer.max_steps=abc", "seed=-1")
    assert str(err.value) == (
        "Invalid configuration:\n"
        "  tracker=nope is not an option: choose one of csv, mlflow, none, tensorboard, wandb\n"
        "  trainer.max_steps='abc' is not allowed: expected an integer >= 1 or null\n"
        "  seed=-1 is not allowed: expected an integer in [0, 2**32)"
    )


@pytest.fixture
def project(tmp_path):
    """A copy of the project's configs with presets of its own for the engine's groups."""
    shutil.copytree(PROJECT_ROOT / "configs", tmp_path / "configs")
    trainer = tmp_path / "configs" / "trainer"
    trainer.mkdir(exist_ok=True)
    typed = "defaults:\n  - schema\n  - _self_\n"
    (trainer / "typo.yaml").write_text(typed + "max_stepz: 100\n")
    (trainer / "wrong_type.yaml").write_text(typed + "max_steps: a hundred\n")
    (trainer / "fp32.yaml").write_text(typed + "mixed_precision: no\nmax_steps: 100\n")
    (trainer / "untyped.yaml").write_text("max_steps: 100\n")  # no schema: completed
    (trainer / "untyped_typo.yaml").write_text("max_stepz: 100\n")
    return tmp_path


def test_a_preset_that_sets_an_undeclared_key_fails_at_composition_naming_it(project):
    with pytest.raises(ConfigError) as err:
        compose_train(project, "trainer=typo")
    assert str(err.value) == (
        "trainer/typo.yaml: trainer.max_stepz is not a key of trainer: did you mean "
        "trainer.max_steps?"
    )
    with pytest.raises(ConfigError) as err:
        compose_train(project, "trainer=wrong_type")
    assert str(err.value) == (
        "trainer/wrong_type.yaml: trainer.max_steps='a hundred' is not allowed: expected an "
        "integer >= 1 or null"
    )
    # A preset composed without the schema is typed and completed when resolved.
    with pytest.raises(ConfigError, match=r"trainer\.max_stepz is not a key of trainer: did"):
        resolve_config(compose_train(project, "trainer=untyped_typo"))
    cfg = resolve_config(compose_train(project, "trainer=untyped"))
    assert cfg.trainer.max_steps == 100 and cfg.trainer.eval_at_start is False  # its default
    check_config(cfg)


def test_yaml_no_null_and_interpolations_keep_working(project):
    cfg = compose_train(project, "trainer=fp32", "trainer.monitor=val/loss")
    assert cfg.trainer.mixed_precision is False  # YAML's `no`, as before
    resolved = resolve_config(cfg)
    check_config(resolved)
    assert resolve_precision(resolved.trainer.mixed_precision, on_cpu=True) == ("no", "")
    assert resolved.checkpoint.save_best.monitor == "val/loss"  # ${trainer.monitor}
    assert resolved.checkpoint.save_best.mode == "max"  # ${trainer.monitor_mode}
    assert resolved.trainer.eval_every_n_steps is None and resolved.trainer.max_epochs == 20
    assert compose_train(project, "trainer.mixed_precision=no").trainer.mixed_precision == "no"


def test_a_config_written_before_a_key_existed_resumes():
    """A checkpoint's config.json of an earlier release lacks the keys added since (a
    parallel=none run had no DDP, FSDP or DeepSpeed keys; checkpoint.async_save was
    checkpoint.async): each counts as its default, so the configs do not differ."""
    current = OmegaConf.to_container(
        resolve_config(compose_train(PROJECT_ROOT, "parallel=none", "checkpoint=none"))
    )
    old = copy.deepcopy(current)
    old["parallel"] = {"mode": "none", "num_processes": 1, "num_nodes": 1}
    old["checkpoint"] = {"enabled": False, "async": False, "init_from": None}
    del old["watchdog"]["collective_timeout_s"], old["trainer"]["eval_at_start"]
    assert config_differences(old, current, allowed_config_changes(current)) == []
    # Not at its default, it is a difference like any other.
    current["parallel"]["zero_stage"] = 3
    assert config_differences(old, current, ()) == [
        "checkpoint.async: False -> '<absent>'",
        "parallel.zero_stage: 2 -> 3",
    ]


def test_the_docs_table_is_the_schemas():
    """docs/configuration.md lists every key as ``python -m training_engine keys`` does."""
    text = (PROJECT_ROOT / "docs" / "configuration.md").read_text()
    assert schema.reference() in text, "run `python -m training_engine keys` into the docs"
    for key in declared_keys():
        assert f"| `{key}` |" in text, key
