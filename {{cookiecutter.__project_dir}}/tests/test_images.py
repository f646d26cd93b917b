"""data=images, the vision example: the CNN trains on the digits written as PNG files
with kornia's random augmentation; a head that does not fit the class folders stops
before any work; predict.py classifies a folder of new files by class name, as the
predictor of load_predictor does; eval.py and predict.py take the run's own data keys."""

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from training_engine.config import ConfigError
from training_engine.testing import run_script

from .conftest import ENV, FAST, PROJECT_ROOT, run_train

pytest.importorskip("PIL", reason="data=images needs the vision extra (pip install -e '.[vision]')")
pytest.importorskip("kornia", reason="the example's augmentation is kornia's (the vision extra)")

from {{ cookiecutter.package_name }}.data.images import images, write_digit_images

CLASSES = [str(d) for d in range(10)]


@pytest.fixture(scope="module")
def digit_pngs(tmp_path_factory) -> Path:
    return write_digit_images(tmp_path_factory.mktemp("pngs") / "digit_images")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, digit_pngs) -> Path:
    run_dir = tmp_path_factory.mktemp("images") / "run"
    run_train(
        run_dir,
        "data=images",
        "model=cnn",
        f"data.train_dir={digit_pngs}",
        *FAST,
        "trainer.max_steps=60",
        "parallel=none",
    )
    return run_dir


def test_the_cnn_trains_on_png_files_and_the_run_keeps_the_class_names(trained):
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["step"] == 60
    assert summary["metrics"]["val/acc"] > 0.25  # chance is 0.1
    assert json.loads((trained / "classes.json").read_text()) == CLASSES


def test_a_head_that_does_not_fit_the_class_folders_exits_2_before_any_work(tmp_path, digit_pngs):
    run = run_train(
        tmp_path / "run",
        "data=images",
        "model=cnn",
        "model.num_classes=5",
        f"data.train_dir={digit_pngs}",
        *FAST,
        check=False,
    )
    assert run.proc.returncode == 2, run.output[-2000:]
    assert "the model scores 5 classes, but the training data has 10" in run.output
    assert not (tmp_path / "run").exists()  # nothing left behind


def predict(trained: Path, out: Path, *overrides: str):
    return run_script(
        PROJECT_ROOT, out, f"ckpt={trained}", *overrides, script="predict.py", env=ENV
    )


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_predict_classifies_a_folder_of_new_files_by_name_as_the_predictor_does(
    tmp_path, trained, digit_pngs
):
    new = tmp_path / "new"  # unlabelled: no class folders
    new.mkdir()
    for digit in ("3", "7"):
        for file in sorted((digit_pngs / digit).glob("*.png"))[:3]:
            shutil.copy(file, new / f"{digit}_{file.name}")
    done = predict(trained, tmp_path / "out", f"files={new}")
    assert done.proc.returncode == 0, done.output[-3000:]
    found = rows(tmp_path / "out" / "predictions.csv")
    assert [Path(r["path"]).name for r in found] == sorted(p.name for p in new.iterdir())
    for row in found:
        assert row["class"] in CLASSES and row["class"] == row["prediction"]
        assert 0 < float(row["probability"]) <= 1
        top = row["top_k_classes"].split()
        assert len(top) == 5 and top[0] == row["class"]
    # a glob, and the predictor of a notebook: the same classes and probabilities
    globbed = predict(trained, tmp_path / "glob", f"files={new}/3_*.png")
    assert globbed.proc.returncode == 0, globbed.output[-3000:]
    assert len(rows(tmp_path / "glob" / "predictions.csv")) == 3
    from training_engine.predictor import load_predictor

    predictor = load_predictor(trained)  # only the data function is looked up
    assert predictor.classes == CLASSES
    one = predictor.predict(found[0]["path"])[0]
    assert one["class"] == found[0]["class"]
    assert one["probability"] == pytest.approx(float(found[0]["probability"]), abs=1e-6)
    # a folder of no images: exit 2, nothing written
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = predict(trained, tmp_path / "refused", f"files={empty}")
    assert refused.proc.returncode == 2 and "no images" in refused.output
    assert not (tmp_path / "refused").exists()


def test_eval_and_predict_take_the_runs_own_data_keys_without_the_group(
    tmp_path, trained, digit_pngs
):
    # a validation folder of two classes only: eval.py scores those files
    val = tmp_path / "val"
    for digit in ("0", "1"):
        shutil.copytree(digit_pngs / digit, val / digit)
    done = run_script(
        PROJECT_ROOT,
        tmp_path / "eval",
        f"ckpt={trained}",
        f"data.val_dir={val}",
        script="eval.py",
        env=ENV,
    )
    assert done.proc.returncode == 0, done.output[-3000:]
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert any("data.val_dir" in d for d in report["config_diff"])
    listed = predict(trained, tmp_path / "pred", f"data.val_dir={val}", "data.val_batch_size=7")
    assert listed.proc.returncode == 0, listed.output[-3000:]
    labels = {r["target"] for r in rows(tmp_path / "pred" / "predictions.csv")}
    assert labels == {"0", "1"}


def write_rgb(folder: Path, count: int, colour: tuple[int, int, int]) -> None:
    from PIL import Image

    folder.mkdir(parents=True)
    for i in range(count):
        Image.new("RGB", (5, 7), colour).save(folder / f"{i}.png")


def test_rgb_and_grayscale_files_are_read_resized_and_checked_against_the_folders(tmp_path):
    write_rgb(tmp_path / "train" / "red", 3, (255, 0, 0))
    write_rgb(tmp_path / "train" / "blue", 3, (0, 0, 255))
    write_rgb(tmp_path / "val" / "red", 2, (255, 0, 0))
    common = {"batch_size": 2, "seed": 0, "train_dir": str(tmp_path / "train"), "augment": []}
    rgb = images(
        **common,
        val_dir=str(tmp_path / "val"),
        channels=3,
        image_size=[6, 4],
        mean=[0.5, 0.5, 0.5],
        std=[0.5, 0.5, 0.5],
    )
    x, y = next(iter(rgb.val))
    assert x.shape == (2, 3, 6, 4) and y.tolist() == [1, 1]  # classes sorted: blue, red
    assert torch.allclose(x[:, 0], torch.ones(1)) and torch.allclose(x[:, 2], -torch.ones(1))
    assert rgb.train.dataset.classes == ["blue", "red"]
    gray = images(**common, val_dir=str(tmp_path / "val"), channels=1)
    assert next(iter(gray.val))[0].shape == (2, 1, 7, 5)
    write_rgb(tmp_path / "val" / "green", 1, (0, 255, 0))
    with pytest.raises(ConfigError, match=r"classes \['green'\] are not among"):
        images(**common, val_dir=str(tmp_path / "val"))
    with pytest.raises(ConfigError, match="no class folders"):
        images(**{**common, "train_dir": str(tmp_path / "val" / "green")})
    with pytest.raises(ConfigError, match=r"data\.channels"):
        images(**common, channels=2)
