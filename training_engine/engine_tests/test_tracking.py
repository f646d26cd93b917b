"""Every tracker, read back with its own reader: TensorBoard's EventAccumulator,
MLflow's MlflowClient and model loader, W&B's offline run file (its protobuf
records), the CSV with the csv module. Real train.py runs: all trackers at once
in one process and under 2-process DDP (one run per tracker), a stopped run
that resumes the same W&B and MLflow runs, a missing package, a shared MLflow
store created by parallel jobs; media (images, histograms, texts) logged through
real trackers in-process."""

import csv
import io
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from digit_trainer.data.digits import load_digits
from digit_trainer.models.digits import MLP
from safetensors.torch import load_file

from training_engine.config import ConfigError, resolve_config
from training_engine.tracking import build_trackers, readiness

from .conftest import FAST, ONE_PROCESS, PATHS, PROJECT_ROOT, require_trackers

ALL = "tracker=[csv,tensorboard,wandb,mlflow]"
LOGGED = {
    "train/loss",
    "train/acc",  # task.loss's log, averaged over the log window
    "train/lr",
    "train/grad_norm",
    "train/epoch",
    "perf/steps_per_sec",
    "perf/samples_per_sec",
    "perf/eval_s",
    "perf/ckpt_blocking_s",
}
EVALUATED = {"val/loss", "val/acc"}


@pytest.fixture
def env(tmp_path):
    """No W&B or MLflow settings from the machine, and a fresh HOME (no
    `wandb login` key): the defaults, offline, as on a machine with no key.
    PYTHONPATH keeps engine_tests.faults importable in the workers."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    (tmp_path / "home").mkdir()
    return {**clean, "HOME": str(tmp_path / "home"), **PATHS}


def train(run_dir: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={run_dir}", ONE_PROCESS, *overrides],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc


# --- each tool's reader --------------------------------------------------------------


def csv_steps(run_dir: Path, name: str) -> list[int]:
    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return [int(r["step"]) for r in rows if r["name"] == name]


def tensorboard_run(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return events


def tensorboard_hparams(events) -> tuple[dict, list[str]]:
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    content = events.PluginTagToContent("hparams")
    start = HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    experiment = HParamsPluginData.FromString(content["_hparams_/experiment"])
    metrics = [m.name.tag for m in experiment.experiment.metric_infos]
    return dict(start.session_start_info.hparams), metrics


def wandb_runs(run_dir: Path) -> list[dict]:
    """Each offline run folder: run id, config keys, {step: logged keys}, the
    logged values ({step: {key: value_json}}) and the folder.

    W&B 0.31 ships no Python reader for its ``.wandb`` files; the format is a
    LevelDB-style log (header ``:W&B`` + 0xBEE1 + version, 32 KiB blocks of
    records: crc32c, length, type, data) of W&B's own protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2

    runs = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (path,) = folder.glob("run-*.wandb")
        data = path.read_bytes()
        assert data[:4] == b":W&B", path
        pos, block, chunk = 7, 32768, b""
        run = {"config": set(), "history": {}, "values": {}, "folder": folder}
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header
                pos += block - pos % block
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            chunk += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind not in (1, 4):  # FULL or LAST ends a record; FIRST/MIDDLE continue
                continue
            record = wandb_internal_pb2.Record.FromString(chunk)
            chunk = b""
            which = record.WhichOneof("record_type")
            if which == "run":
                run["id"] = record.run.run_id
            elif which == "config":
                run["config"] |= {item.key for item in record.config.update}
            elif which == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                run["history"][int(items["_step"])] = set(items)
                run["values"].setdefault(int(items["_step"]), {}).update(items)
        runs.append(run)
    return runs


def mlflow_client(run_dir: Path):
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")


def mlflow_runs(client) -> list:
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(experiments)


def metric_steps(client, run_id: str, name: str) -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, name)]


# --- tests ------------------------------------------------------------------------------


def test_every_tracker_at_once_reads_back(tmp_path, env):
    require_trackers("tensorboard", "wandb", "mlflow")
    run_dir = tmp_path / "run"
    train(run_dir, env, *FAST, ALL, "tracker.wandb.watch.log_freq=5")
    steps = [5, 10, 15, 20, 25, 30]

    # CSV: every logged value at every logged step.
    assert csv_steps(run_dir, "train/loss") == steps
    assert csv_steps(run_dir, "val/acc") == [10, 20, 30]

    # TensorBoard: scalars, and the config as hparams with the metric columns.
    events = tensorboard_run(run_dir)
    assert set(events.Tags()["scalars"]) == LOGGED | EVALUATED
    assert [s.step for s in events.Scalars("train/loss")] == steps
    hparams, metrics = tensorboard_hparams(events)
    assert hparams["optimizer/lr"].number_value == pytest.approx(3e-3)
    assert hparams["optimizer/betas"].string_value == "[0.9, 0.999]"  # a list, as text
    assert metrics == ["val/acc", "val/loss", "train/loss"]

    # W&B: one offline run (no key, no WANDB_MODE), its config, every logged key
    # at its step, and wandb.watch's histograms.
    (run,) = wandb_runs(run_dir)
    assert {"optimizer/lr", "optimizer/betas", "tracker/wandb/mode"} <= run["config"]
    assert sorted(s for s, keys in run["history"].items() if "train/loss" in keys) == steps
    assert run["history"][30] >= EVALUATED
    assert any(k.startswith("gradients/") for keys in run["history"].values() for k in keys)
    assert any(k.startswith("parameters/") for keys in run["history"].values() for k in keys)
    assert (run_dir / "wandb" / "cache").is_dir()  # W&B's cache in the run dir, not ~

    # MLflow: metric history, params, the weights file, and a loadable model.
    client = mlflow_client(run_dir)
    (found,) = mlflow_runs(client)
    run_id = found.info.run_id
    assert found.info.status == "FINISHED"
    assert metric_steps(client, run_id, "train/loss") == steps
    assert metric_steps(client, run_id, "val/acc") == [10, 20, 30]
    assert found.data.params["optimizer/lr"] == "0.003"
    assert found.data.params["tracker/mlflow/tracking_uri"] == "None"
    assert [a.path for a in client.list_artifacts(run_id)] == ["model.safetensors"]
    import mlflow.pytorch

    mlflow.set_tracking_uri(client.tracking_uri)
    loaded = mlflow.pytorch.load_model(f"runs:/{run_id}/model")
    reference = MLP(in_features=64, num_classes=10, width=128, depth=2)
    reference.load_state_dict(load_file(run_dir / "model.safetensors"))
    reference.eval()
    images = load_digits()[0][:50]
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), reference(images))

    # The checkpoints hold the W&B and MLflow run ids.
    state = json.loads((run_dir / "checkpoints/step_0000030/trainer_state.json").read_text())
    assert state["tracker_run_ids"] == {"wandb": run["id"], "mlflow": run_id}


@pytest.mark.multiprocess
def test_ddp_makes_one_run_per_tracker(tmp_path, env):
    require_trackers("tensorboard", "wandb", "mlflow")
    run_dir = tmp_path / "run"
    train(run_dir, env, *FAST, ALL, "parallel=ddp", "parallel.cpu_processes=2")
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    assert (run_dir / "train_rank1.log").is_file()  # rank 1 trained too

    rows = Counter(csv_steps(run_dir, "train/loss"))
    assert set(rows) == {5, 10, 15, 20, 25, 30} and set(rows.values()) == {1}
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert [s.step for s in tensorboard_run(run_dir).Scalars("val/acc")] == [10, 20, 30]
    (run,) = wandb_runs(run_dir)
    assert sorted(s for s, keys in run["history"].items() if "val/acc" in keys) == [10, 20, 30]
    client = mlflow_client(run_dir)
    (found,) = mlflow_runs(client)
    assert metric_steps(client, found.info.run_id, "val/acc") == [10, 20, 30]


@pytest.mark.multiprocess
def test_stopped_run_resumes_the_same_wandb_and_mlflow_runs(tmp_path, env):
    """SIGTERM: the run saves and exits 143. The same command resumes: the same
    W&B run id (a second offline folder, as W&B does offline) and the same
    MLflow run, with the steps going on where the checkpoint left off."""
    require_trackers("tensorboard", "wandb", "mlflow")
    run_dir = tmp_path / "run"
    args = [f"hydra.run.dir={run_dir}", "tracker=[tensorboard,wandb,mlflow]"]
    args += ["model._target_=engine_tests.faults.Slow", "trainer.max_steps=40"]
    args += ["trainer.log_every_n_steps=5", "trainer.eval_every_n_steps=10"]
    args += ["checkpoint.every_n_steps=10", "tracker.wandb.watch.log=null"]
    first = subprocess.Popen(
        [sys.executable, "train.py", ONE_PROCESS, *args],
        cwd=PROJECT_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "step_0000010").is_dir():
        assert first.poll() is None and time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == 143
    stopped = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"]
    assert 10 <= stopped < 40
    saved = json.loads(
        (run_dir / "checkpoints" / f"step_{stopped:07d}" / "trainer_state.json").read_text()
    )["tracker_run_ids"]

    resumed = train(run_dir, env, *args[1:])
    assert f"resumed from {run_dir / 'checkpoints'}" in resumed.stdout + resumed.stderr
    every = list(range(5, 41, 5))

    before, after = wandb_runs(run_dir)
    assert before["id"] == after["id"] == saved["wandb"]
    logged = lambda run: sorted(s for s, k in run["history"].items() if "train/loss" in k)  # noqa: E731
    assert logged(before) == [s for s in every if s <= stopped]
    assert logged(after) == [s for s in every if s > stopped]

    client = mlflow_client(run_dir)
    (found,) = mlflow_runs(client)
    assert found.info.run_id == saved["mlflow"] and found.info.status == "FINISHED"
    assert metric_steps(client, found.info.run_id, "train/loss") == every

    assert [s.step for s in tensorboard_run(run_dir).Scalars("train/loss")] == every


def test_missing_package_names_the_install_command(tmp_path, env):
    """Run train.py with wandb made unimportable (``sys.modules["wandb"] = None``
    is Python's way to block an import): it stops before any work."""
    run_dir = tmp_path / "run"
    script = (
        "import runpy, sys; sys.modules['wandb'] = None; "
        f"sys.argv = ['train.py', 'hydra.run.dir={run_dir}', 'tracker=[csv,wandb]']; "
        "runpy.run_path('train.py', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "tracker=wandb needs wandb, not installed here: pip install -e '.[wandb]'" in out
    assert "Traceback" not in out and not (run_dir / "metrics.csv").exists()


@pytest.mark.parametrize(
    ("tracker", "module"), [("tensorboard", "tensorboard"), ("mlflow", "sqlalchemy")]
)
def test_every_missing_package_is_named(compose_cfg, tmp_path, monkeypatch, tracker, module):
    monkeypatch.setitem(sys.modules, module, None)  # blocks the import
    cfg = resolve_config(compose_cfg(f"tracker={tracker}"))
    hint = rf"tracker={tracker} needs [\w, ]*{module}.*: pip install -e '\.\[{tracker}\]'"
    with pytest.raises(ConfigError, match=hint):
        build_trackers(cfg, tmp_path)


def test_readiness_for_preflight_uses_requires_and_the_wandb_host(
    compose_cfg, tmp_path, monkeypatch
):
    """Preflight's tracker check is tracking.readiness: the packages of REQUIRES
    (MLflow needs sqlalchemy too), and the W&B key of WANDB_BASE_URL's host."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    netrc = tmp_path / ".netrc"
    netrc.write_text("machine wandb.example.com login user password secret\n")
    netrc.chmod(0o600)
    cfg = resolve_config(compose_cfg("tracker=[csv,wandb,mlflow]"))
    status, detail, _ = readiness(cfg)
    assert status == "pass" and "wandb: offline" in detail  # no key for api.wandb.ai
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    status, detail, _ = readiness(cfg)
    assert status == "pass", detail
    assert "wandb: online, key found for wandb.example.com" in detail
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # blocks the import
    status, detail, fix = readiness(cfg)
    assert status == "fail" and "mlflow: sqlalchemy not installed" in detail
    assert fix == "pip install -e '.[mlflow]'"


SHARED_STORE_JOB = """
import sys
from pathlib import Path
from training_engine.trackers import MLflowTracker

store, job = sys.argv[1], sys.argv[2]
tracker = MLflowTracker("sweep", Path(store).parent / job, tracking_uri=f"sqlite:///{store}")
tracker.start()
tracker.store_init_configuration(
    {"job": job, "model/a@b[0]": 1, "k" * 300: "v" * 7000, "tags": "[1, 2]", "/x//y/": 2}
)
tracker.log({"loss": float(job)}, step=1)
tracker.finish()
"""


@pytest.mark.multiprocess
def test_parallel_jobs_share_one_mlflow_store(tmp_path, env):
    """Three jobs start at once on one new sqlite store (as a sweep with a
    parallel launcher does): one creates it and the experiment, none fails.
    Keys MLflow refuses are made acceptable, long ones cut to its limits."""
    require_trackers("mlflow")
    store = tmp_path / "shared" / "mlflow.db"
    jobs = [
        subprocess.Popen(
            [sys.executable, "-c", SHARED_STORE_JOB, str(store), str(job)],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for job in range(3)
    ]
    outputs = [job.communicate(timeout=300)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0] * 3, outputs
    client = mlflow_client(store.parent)
    (experiment,) = [e for e in client.search_experiments() if e.name == "sweep"]
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.data.params["job"] for r in runs) == ["0", "1", "2"]
    params = runs[0].data.params
    assert params["model/a_b_0_"] == "1" and params["tags"] == "[1, 2]" and params["x/y"] == "2"
    assert params["k" * 250] == "v" * 6000
    assert experiment.artifact_location == str(store.parent / "mlflow-artifacts")


# --- media: images, histograms, texts -----------------------------------------------


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """The ``env`` fixture's settings for trackers started in this process."""
    for var in [v for v in os.environ if v.startswith(("WANDB_", "MLFLOW_"))]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # restored after the test
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def png_pixels(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)))


def test_media_reach_every_tracker_and_read_back(tmp_path, offline):
    """One image (a float C,H,W tensor), a grey uint8 array, a histogram and a text
    through real trackers started in this process; each read back with the
    tracker's own reader: the same pixels, counts and text everywhere, and no
    media in metrics.csv."""
    require_trackers("tensorboard", "wandb", "mlflow")
    from accelerate import Accelerator
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from training_engine.media import Media
    from training_engine.trackers import (
        CSVTracker,
        MLflowTracker,
        TensorBoardTracker,
        WandBTracker,
    )

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    trackers = [CSVTracker(run_dir), TensorBoardTracker(run_dir)]
    trackers += [WandBTracker("media", run_dir), MLflowTracker("media", run_dir)]
    accelerator = Accelerator(cpu=True, log_with=trackers)
    media = Media(accelerator, run_dir)  # before the trackers start, as train.py may
    accelerator.init_trackers("media")
    generator = torch.Generator().manual_seed(0)
    image = torch.rand(3, 6, 8, generator=generator)
    grey = np.arange(12 * 5, dtype=np.uint8).reshape(12, 5) * 4
    values = torch.randn(1000, generator=generator)
    text = "step 5: *ünïcode* text\nsecond line"
    accelerator.log({"train/loss": 1.0}, step=5)
    media.image("val/samples", image, step=5)
    media.image("grey", grey, step=5)
    media.histogram("weights", values, step=5)
    media.text("gen/text", text, step=5)
    accelerator.end_training()

    pixels = (image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    counts, edges = np.histogram(values.double().numpy(), bins=64)

    # csv: files in the run dir; metrics.csv has the scalar only.
    step_dir = run_dir / "media" / "step_0000005"
    np.testing.assert_array_equal(png_pixels((step_dir / "val/samples.png").read_bytes()), pixels)
    np.testing.assert_array_equal(png_pixels((step_dir / "grey.png").read_bytes()), grey)
    saved = json.loads((step_dir / "weights.json").read_text())
    assert saved["counts"] == counts.tolist() and saved["edges"] == edges.tolist()
    assert saved["num"] == 1000 and saved["max"] == pytest.approx(values.max().item())
    assert (step_dir / "gen/text.txt").read_text(encoding="utf-8") == text
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [(r["step"], r["name"]) for r in rows] == [("5", "train/loss")]

    # TensorBoard: image, histogram and text events at step 5 in the run's event file.
    guidance = {"images": 0, "histograms": 0, "tensors": 0}
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance=guidance)
    events.Reload()
    (shown,) = events.Images("val/samples")
    assert shown.step == 5 and (shown.width, shown.height) == (8, 6)
    np.testing.assert_array_equal(png_pixels(shown.encoded_image_string), pixels)
    (shown,) = events.Images("grey")  # shown as RGB, three equal channels
    np.testing.assert_array_equal(png_pixels(shown.encoded_image_string), np.stack([grey] * 3, 2))
    (hist,) = events.Histograms("weights")
    assert hist.step == 5 and list(hist.histogram_value.bucket) == counts.tolist()
    assert list(hist.histogram_value.bucket_limit) == edges[1:].tolist()
    (written,) = events.Tensors("gen/text/text_summary")
    assert written.step == 5 and written.tensor_proto.string_val[0].decode() == text

    # W&B: the run's history at step 5 (W&B flattens a value's fields to
    # <key>/<field>); the image and the table are files of the run.
    (run,) = wandb_runs(run_dir)
    logged = {k: json.loads(v) for k, v in run["values"][5].items()}
    files = run["folder"] / "files"
    assert logged["val/samples/_type"] == "image-file"
    np.testing.assert_array_equal(
        png_pixels((files / logged["val/samples/path"]).read_bytes()), pixels
    )
    assert logged["weights/_type"] == "histogram"
    assert logged["weights/values"] == counts.tolist()
    assert logged["weights/bins"] == edges.tolist()
    assert logged["gen/text/_type"] == "table-file"
    table = json.loads((files / logged["gen/text/path"]).read_text())
    assert table["columns"] == ["text"] and table["data"] == [[text]]

    # MLflow: artifacts under media/step_0000005/.
    client = mlflow_client(run_dir)
    (found,) = mlflow_runs(client)
    run_id = found.info.run_id
    listed = {a.path for a in client.list_artifacts(run_id, "media/step_0000005")}
    assert listed == {f"media/step_0000005/{p}" for p in ("val", "grey.png", "weights.json", "gen")}
    local = Path(client.download_artifacts(run_id, "media", str(tmp_path / "mlflow")))
    np.testing.assert_array_equal(
        png_pixels((local / "step_0000005/val/samples.png").read_bytes()), pixels
    )
    assert json.loads((local / "step_0000005/weights.json").read_text()) == saved
    assert (local / "step_0000005/gen/text.txt").read_text(encoding="utf-8") == text


def test_media_bad_input_is_one_clear_error_and_nothing_written(tmp_path):
    """Checked before any tracker sees it (csv here: no file): the bad value and
    what is allowed."""
    from accelerate import Accelerator

    from training_engine.media import Media
    from training_engine.trackers import CSVTracker

    accelerator = Accelerator(cpu=True, log_with=[CSVTracker(tmp_path)])
    accelerator.init_trackers("media")
    media = Media(accelerator, tmp_path)
    bad = [
        (lambda: media.image("../up", torch.zeros(4, 4), step=1), r"name '\.\./up': use letters"),
        (lambda: media.image("a", torch.zeros(4, 4), step=-1), r"step=-1, a non-negative int"),
        (lambda: media.image("a", torch.zeros(2, 4, 4), step=1), r"\(2, 4, 4\); a tensor is C"),
        (lambda: media.image("a", np.zeros((3, 4, 5)), step=1), r"\(3, 4, 5\); an array is H"),
        (lambda: media.image("a", torch.full((4, 4), 2.0), step=1), r"from 2\.0 to 2\.0; a float"),
        (lambda: media.image("a", torch.zeros(4, 4, dtype=torch.int64), step=1), "dtype int64"),
        (lambda: media.image("a", [[0.5]], step=1), "got list"),
        (lambda: media.histogram("h", [1.0, float("nan")], step=1), "not finite"),
        (lambda: media.histogram("h", [], step=1), "no values"),
        (lambda: media.histogram("h", [1.0], step=1, bins=0), r"bins=0; an int in 1\.\.512"),
        (lambda: media.text("t", 3, step=1), "a str is needed, got int"),
    ]
    for call, message in bad:
        with pytest.raises((ValueError, TypeError), match=message):
            call()
    accelerator.end_training()
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]  # no media/
