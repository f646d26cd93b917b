"""A model's life around training, on real runs: eval.py, predict.py, load_model,
fine-tuning (init_from), early stopping, EMA and the debug presets."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from safetensors.torch import load_file

from training_engine.config import (
    ConfigError,
    check_config,
    register_resolvers,
    resolve_config,
)
from training_engine.early_stopping import EarlyStopping
from training_engine.finetune import init_from
from training_engine.inference import load_model, resolve_checkpoint
from training_engine.metrics import MetricBook

from .conftest import CONFIG_DIR, FAST, ONE_PROCESS, PROJECT_ROOT, run_train
from .test_checkpoint import ckpt_dir, kill_when_paused

# One short run shared by the eval/predict/load_model/init_from tests: 30 steps,
# evaluated and saved every 10, with EMA (a low decay, so it differs visibly).
SHARED = [*FAST, "checkpoint.every_n_steps=10", "trainer.ema.enabled=true", "trainer.ema.decay=0.9"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_train(tmp_path_factory.mktemp("lifecycle") / "run", *SHARED)


def run_script(script: str, out_dir: Path, *overrides: str, check: bool = True):
    cmd = [sys.executable, script, f"hydra.run.dir={out_dir}", ONE_PROCESS, *overrides]
    proc = subprocess.run(
        cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return proc


def test_eval_runs_one_process_and_equals_the_training_bit_for_bit(tmp_path):
    """With the bake's own parallel default (DDP in a one_node bake): eval.py runs one
    process unless told otherwise, and its metrics are the training's, bit for bit
    (task.evaluate averages per batch in the loader's order: any world size)."""
    run = run_train(tmp_path / "run", *FAST, "data.val_batch_size=48", as_baked=True)
    cmd = [sys.executable, "eval.py", f"hydra.run.dir={tmp_path / 'eval'}", f"ckpt={run.run_dir}"]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert report["world_size"] == 1
    for name, value in report["metrics"].items():  # the step the best checkpoint saved at
        assert value == recorded(run.run_dir, name)[report["step"]], name


def recorded(run_dir: Path, name: str) -> dict[int, float]:
    """A metric's values by step, as the training run's metrics.csv logged them."""
    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return {int(r["step"]): float(r["value"]) for r in rows if r["name"] == name}


def expected_predictions(run_dir: Path) -> tuple[list[int], list[int]]:
    """argmax(model(x)) over the validation split, computed here, and the labels."""
    model = load_model(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    val = instantiate(OmegaConf.create(config["data"])).val.dataset
    x, y = val.tensors
    with torch.no_grad():
        return model(x).argmax(dim=-1).tolist(), y.tolist()


def read_predictions(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


def test_eval_reproduces_the_recorded_metrics(trained, tmp_path):
    best = trained.summary["best"]
    run_script("eval.py", tmp_path / "best", f"ckpt={trained.run_dir}")
    report = json.loads((tmp_path / "best" / "eval.json").read_text())
    assert report["step"] == best["step"]
    assert Path(report["checkpoint"]) == ckpt_dir(trained.run_dir, best["step"]).resolve()
    assert report["weights"] == "raw" and report["world_size"] == 1
    for name in ("val/acc", "val/loss"):
        assert report["metrics"][name] == pytest.approx(
            recorded(trained.run_dir, name)[best["step"]], abs=1e-6
        )
    assert report["config_diff"] == []

    # The newest checkpoint's EMA weights, with an override: val_ema/* of step 30.
    out = tmp_path / "ema"
    run_script(
        "eval.py",
        out,
        f"ckpt={trained.run_dir}",
        "ckpt_pick=latest",
        "weights=ema",
        "data.val_batch_size=64",
    )
    report = json.loads((out / "eval.json").read_text())
    assert report["step"] == 30 and report["weights"] == "ema"
    for name in ("acc", "loss"):
        logged = recorded(trained.run_dir, f"val_ema/{name}")[30]
        assert report["metrics"][f"val/{name}"] == pytest.approx(logged, abs=1e-6)
        assert logged != recorded(trained.run_dir, f"val/{name}")[30]  # EMA differs from raw
    assert report["config_diff"] == ["data.val_batch_size: 512 -> 64"]

    # Bad input: exit 2 naming the value and what is allowed, before any work; no dir left.
    proc = run_script("eval.py", tmp_path / "bad", "ckpt=no/such/run", check=False)
    assert proc.returncode == 2
    assert "ckpt='no/such/run' is not allowed: expected a run dir" in proc.stdout + proc.stderr
    assert not (tmp_path / "bad").exists()


def test_help_lists_the_keys_that_matter():
    """What ``python eval.py --help`` / ``predict.py --help`` print (Hydra's help
    template), composed in-process: a subprocess per script would cost ~10 s."""
    register_resolvers(PROJECT_ROOT)
    for name in ("eval", "predict"):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose(name, overrides=["ckpt=x"], return_hydra_config=True)
        text = cfg.hydra.help.template
        for key in ("ckpt=PATH", "ckpt_pick=best", "weights=raw", "parallel=none", "Example"):
            assert key in text, (name, key)
        assert cfg.hydra.help.app_name == f"{name}.py"
    assert "split=val" in text and "files=PATHS" in text  # predict.py's own


def test_predict_writes_argmax_in_dataset_order(trained, tmp_path):
    run_script("predict.py", tmp_path, f"ckpt={trained.run_dir}")
    rows = read_predictions(tmp_path / "predictions.csv")
    predictions, labels = expected_predictions(trained.run_dir)
    assert [int(r["index"]) for r in rows] == list(range(len(labels))) and len(labels) == 359
    assert [int(r["prediction"]) for r in rows] == predictions
    assert [int(r["target"]) for r in rows] == labels


def test_ddp_eval_and_predictions_equal_one_process(trained, tmp_path):
    # 359 samples in batches of 40: 9 batches, so the 2nd rank's 5th batch is the
    # distributed sampler's padding (repeated samples), which must not show up.
    run_script(
        "eval.py",
        tmp_path,
        f"ckpt={trained.run_dir}",
        "parallel=ddp",
        "predict=true",
        "data.val_batch_size=40",
    )
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["world_size"] == 2
    best = trained.summary["best"]
    assert report["metrics"]["val/acc"] == pytest.approx(
        recorded(trained.run_dir, "val/acc")[best["step"]], abs=1e-6
    )
    rows = read_predictions(tmp_path / "predictions.csv")
    predictions, labels = expected_predictions(trained.run_dir)
    assert [int(r["index"]) for r in rows] == list(range(359))
    assert [int(r["prediction"]) for r in rows] == predictions
    assert [int(r["target"]) for r in rows] == labels


def test_load_model_returns_the_checkpoint_weights(trained):
    best = ckpt_dir(trained.run_dir, trained.summary["best"]["step"])
    model = load_model(trained.run_dir)
    assert not model.training
    saved = load_file(best / "model.safetensors")
    state = model.state_dict()
    assert set(state) == set(saved) and all(torch.equal(state[k], saved[k]) for k in saved)

    ema = load_model(trained.run_dir, pick="latest", weights="ema").state_dict()
    averaged = load_file(ckpt_dir(trained.run_dir, 30) / "ema.safetensors")
    assert all(torch.equal(ema[k], averaged[f"module.{k}"]) for k in ema)
    raw = load_file(ckpt_dir(trained.run_dir, 30) / "model.safetensors")
    assert not all(torch.equal(ema[k], raw[k]) for k in ema)
    assert resolve_checkpoint(best) == best.resolve()  # one step_* dir: exactly that one
    with pytest.raises(
        ConfigError, match="pick='worst' is not allowed: expected one of best, latest"
    ):
        load_model(trained.run_dir, pick="worst")


def test_init_from_strict_and_not_strict(trained, tmp_path):
    # One layer changed: a 12-class head instead of 10.
    config = json.loads((trained.run_dir / "config.json").read_text())
    wider = instantiate(OmegaConf.create({**config["model"], "num_classes": 12}))
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(ConfigError, match=r"mismatched \['net.7.bias', 'net.7.weight'\]"):
        init_from({"init_from": str(trained.run_dir), "init_from_strict": True}, model=wider)
    assert all(torch.equal(before[k], v) for k, v in wider.state_dict().items())  # untouched

    run = run_train(
        tmp_path / "finetuned",
        *FAST,
        "trainer.max_steps=10",
        "model.num_classes=12",
        f"checkpoint.init_from={trained.run_dir}",
        "checkpoint.init_from_strict=false",
        "trainer.eval_at_start=true",  # where the fine-tune starts, logged at step 0
    )
    report = run.summary["init_from"]
    assert report["missing"] == [] and report["unexpected"] == []
    assert report["mismatched"] == [
        {"key": "net.7.bias", "checkpoint": [10], "model": [12]},
        {"key": "net.7.weight", "checkpoint": [10, 128], "model": [12, 128]},
    ]
    assert (
        Path(report["source"])
        == ckpt_dir(trained.run_dir, trained.summary["best"]["step"]).resolve()
    )
    assert "init_from" in run.output and "mismatched net.7.bias [10] -> [12]" in run.output
    # A new run: from step 0 (the source has 30 steps), a fresh optimizer.
    assert run.summary["step"] == 10 and run.summary["resumed_from"] is None
    assert sorted(recorded(run.run_dir, "train/loss")) == [5, 10]
    assert sorted(recorded(run.run_dir, "val/loss")) == [0, 10]
    optimizer = torch.load(ckpt_dir(run.run_dir, 10) / "optimizer.pt", weights_only=True)
    assert {float(s["step"]) for s in optimizer["state"].values()} == {10.0}


def test_early_stopping_rule():
    book = MetricBook("val/loss", "min")  # one book decides every best of the run
    stopper = EarlyStopping(patience=2, min_delta=0.01, monitor="val/loss", mode="min", book=book)

    def observe(step: int, value: float) -> bool:
        book.update({"val/loss": value}, step)
        return stopper.observe(step)

    assert [observe(s, v) for s, v in enumerate([1.0, 0.995, 0.9, 0.895, 0.9])] == [
        False,
        False,
        False,
        False,
        True,
    ]
    assert stopper.stopped_step == 4 and stopper.best == 0.9
    assert book.best_value == 0.895  # trainer.monitor's best: any improvement counts
    again = EarlyStopping(patience=2, monitor="val/loss", mode="min", book=MetricBook("x", "max"))
    again.load_state_dict(json.loads(json.dumps(stopper.state_dict())))
    assert again.stopped and again.bad_evaluations == 2
    with pytest.raises(ConfigError, match=r"trainer\.early_stopping\.patience=0 is not allowed"):
        EarlyStopping(patience=0, monitor="val/loss", mode="min", book=book)


def test_bad_lifecycle_keys_fail_before_any_work(compose_cfg, tmp_path):
    """Each bad value is named with what is allowed, all at once."""
    cfg = resolve_config(
        compose_cfg(
            "parallel=fsdp",
            "trainer.ema.enabled=true",
            "trainer.ema.decay=1.5",
            "trainer.early_stopping.patience=0",
            f"checkpoint.init_from={tmp_path / 'nowhere'}",
            "checkpoint.init_from_pick=worst",
        )
    )
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    for message in (
        "trainer.ema.decay=1.5 is not allowed: expected a number between 0 and 1",
        "trainer.early_stopping.patience=0 is not allowed: expected an integer >= 1 or null",
        f"checkpoint.init_from='{tmp_path / 'nowhere'}' is not allowed: expected null or an",
        "checkpoint.init_from_pick='worst' is not allowed: expected best or latest",
        "trainer.ema.enabled=true is not supported with parallel=fsdp (sharded parameters)",
    ):
        assert message in str(err.value)


# Evaluated every 5 steps; no evaluation improves val/acc by more than 1.0, so the
# first sets the baseline and patience 2 runs out at the third: step 15 of 40.
STOPS_EARLY = [
    "trainer.max_steps=40",
    "trainer.log_every_n_steps=5",
    "trainer.eval_every_n_steps=5",
    "tracker=csv",
    "preflight=off",
    "checkpoint.every_n_steps=5",
    "trainer.early_stopping.patience=2",
    "trainer.early_stopping.min_delta=1.0",
    "trainer.ema.enabled=true",
    "trainer.ema.decay=0.9",
]


def test_early_stopping_and_ema_resume_after_kill_9(tmp_path):
    reference = run_train(tmp_path / "reference", *STOPS_EARLY)
    assert reference.summary["step"] == 15
    assert reference.summary["early_stopping"] == {
        "stopped": True,
        "step": 15,
        "reason": reference.summary["early_stopping"]["reason"],
        "bad_evaluations": 2,
    }
    assert "val/acc did not improve by more than 1" in reference.summary["early_stopping"]["reason"]
    assert sorted(recorded(reference.run_dir, "val_ema/acc")) == [5, 10, 15]
    assert (reference.run_dir / "model.safetensors").is_file()  # the run ends as usual

    # SIGKILL while step 15 is being saved: step 10 (one evaluation without
    # improvement) is the newest checkpoint; the resume keeps that count.
    run_dir = tmp_path / "killed"
    kill_when_paused(run_dir, "before_rename", 15, *STOPS_EARLY)
    state = json.loads((ckpt_dir(run_dir, 10) / "trainer_state.json").read_text())
    assert state["stateful"]["early_stopping"]["bad_evaluations"] == 1
    assert "ema" not in state["stateful"]  # tensors: in ema.safetensors
    resumed = run_train(run_dir, *STOPS_EARLY)
    assert resumed.summary["resumed_from"] == str(ckpt_dir(run_dir, 10))
    assert resumed.summary["step"] == 15 and resumed.summary["early_stopping"]["step"] == 15
    for name in ("ema.safetensors", "model.safetensors"):  # bit-exact, EMA included
        ours, theirs = ckpt_dir(run_dir, 15) / name, ckpt_dir(reference.run_dir, 15) / name
        assert ours.read_bytes() == theirs.read_bytes(), name


@pytest.mark.slow  # a 2-process DDP training run (~20 s) beyond CI's budget
def test_early_stopping_and_ema_under_ddp(tmp_path):
    run = run_train(tmp_path / "ddp", *STOPS_EARLY, "parallel=ddp")
    assert run.summary["world_size"] == 2 and run.summary["step"] == 15
    assert run.summary["early_stopping"]["step"] == 15
    logged = recorded(run.run_dir, "val_ema/acc")
    assert sorted(logged) == [5, 10, 15]
    # The saved average is what was evaluated: its accuracy, recomputed here, is the logged one.
    model = load_model(run.run_dir, pick="latest", weights="ema")
    config = json.loads((run.run_dir / "config.json").read_text())
    x, y = instantiate(OmegaConf.create(config["data"])).val.dataset.tensors
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=-1) == y).float().mean().item()
    assert accuracy == pytest.approx(logged[15], abs=1e-6)


def test_debug_presets(tmp_path, compose_cfg):
    assert "/debug/" in compose_cfg("debug=fast", hydra_config=True).hydra.run.dir  # throwaway
    fast = run_train(tmp_path / "fast", "debug=fast")
    assert fast.summary["step"] == 4
    assert (
        not (fast.run_dir / "checkpoints").exists()
        and not (fast.run_dir / "preflight.json").exists()
    )
    assert not (fast.run_dir / "metrics.csv").exists()  # no trackers

    profile = run_train(tmp_path / "profile", "debug=profile")
    trace = json.loads((profile.run_dir / "profile" / "trace_rank0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"aten::addmm", "aten::linear", "Optimizer.step#AdamW.step"} <= names  # the MLP's ops
    assert sum(1 for n in names if str(n).startswith("ProfilerStep#")) == 5  # the active window
    table = (profile.run_dir / "profile" / "top_ops_rank0.txt").read_text()
    assert "aten::addmm" in table and "Self CPU" in table

    # A NaN: anomaly mode names the backward op that produced it, with the forward's traceback.
    anomaly = run_train(
        tmp_path / "anomaly",
        "debug=anomaly",
        "preflight=off",
        "trainer.max_steps=5",
        "optimizer.lr=1e30",
        check=False,
    )
    assert anomaly.proc.returncode == 1
    assert "Function 'LogSoftmaxBackward0' returned nan values" in anomaly.output
    assert "Traceback of forward call that caused the error" in anomaly.output


@pytest.mark.slow  # 150 steps (~18 s) beyond CI's budget; test_debug_presets covers the others
def test_debug_overfit(tmp_path):
    overfit = run_train(tmp_path / "overfit", "debug=overfit")
    assert "debug: training on the first 128 samples, every epoch" in overfit.output
    assert overfit.summary["metrics"]["val/acc"] == 1.0  # memorised the two batches
    assert overfit.summary["metrics"]["train/loss"] < 0.05
